"""The modal questions the window asks, in one object so that tests can answer them."""
from __future__ import annotations

from pathlib import Path
from tkinter import filedialog, messagebox

MODEL_FILES = [("Model files", "*.safetensors *.ckpt"), ("All files", "*")]
CONFIG_FILES = [("Tandem config", "*.json")]
IMAGE_FILES = [("Images", "*.png *.jpg *.jpeg *.webp"), ("All files", "*")]


def start_folder(value: str | Path | None) -> str:
    """Where a file or folder dialog opens for a field holding `value`: that folder, the file's folder, or the
    nearest folder above it that exists - but the home folder when none of the path's own folders exists
    (an empty field, `builtin:demo`, a preset's placeholder), not the folder the program was started in."""
    text = str(value or "").strip()
    if not text or text.startswith("builtin:"):
        return str(Path.home())
    path = Path(text).expanduser().absolute()
    cwd = Path.cwd().absolute()
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return str(Path.home()) if candidate in (cwd, *cwd.parents) and candidate != path else str(candidate)
    return str(Path.home())


class Dialogs:
    def ask_save_changes(self, name: str) -> bool | None:
        """True: save, False: discard, None: cancel."""
        return messagebox.askyesnocancel("Unsaved changes", f"Save the changes to {name}?")

    def ask_yes_no(self, title: str, text: str) -> bool:
        return messagebox.askyesno(title, text)

    def ask_open_path(self, start: str | None = None) -> str:
        return filedialog.askopenfilename(title="Load config", filetypes=CONFIG_FILES,
                                          initialdir=start or str(Path.home()))

    def ask_save_path(self, suggested: str, start: str | None = None) -> str:
        return filedialog.asksaveasfilename(title="Save config as", defaultextension=".json", initialfile=suggested,
                                            filetypes=CONFIG_FILES, initialdir=start or str(Path.home()))

    def ask_folder(self, title: str, start: str) -> str:
        return filedialog.askdirectory(title=title, initialdir=start, mustexist=False)

    def ask_file(self, title: str, start: str) -> str:
        return filedialog.askopenfilename(title=title, initialdir=start, filetypes=MODEL_FILES)

    def ask_image(self, title: str, start: str) -> str:
        return filedialog.askopenfilename(title=title, initialdir=start, filetypes=IMAGE_FILES)

    def ask_new_file(self, title: str, start: str) -> str:
        """A file to write (the Tools tab's outputs): it need not exist."""
        return filedialog.asksaveasfilename(title=title, initialdir=start, filetypes=MODEL_FILES)

    def show_error(self, title: str, text: str) -> None:
        messagebox.showerror(title, text)

    def ask_import_path(self) -> str:
        return filedialog.askopenfilename(title="Import a kohya or OneTrainer config",
                                          filetypes=[("kohya or OneTrainer config", "*.toml *.json"), ("All", "*")])

    def show_info(self, title: str, text: str) -> None:
        messagebox.showinfo(title, text)
