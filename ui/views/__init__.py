"""customtkinter views: thin layers over the Tk-free controllers in `ui/`."""
