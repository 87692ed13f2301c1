"""The modal questions the window asks, in one object so that tests can answer them."""
from __future__ import annotations

from tkinter import filedialog, messagebox


class Dialogs:
    def ask_save_changes(self, name: str) -> bool | None:
        """True: save, False: discard, None: cancel."""
        return messagebox.askyesnocancel("Unsaved changes", f"Save the changes to {name}?")

    def ask_yes_no(self, title: str, text: str) -> bool:
        return messagebox.askyesno(title, text)

    def ask_open_path(self) -> str:
        return filedialog.askopenfilename(title="Load config", filetypes=[("Tandem config", "*.json")])

    def ask_save_path(self, suggested: str) -> str:
        return filedialog.asksaveasfilename(title="Save config as", defaultextension=".json",
                                            initialfile=suggested, filetypes=[("Tandem config", "*.json")])

    def show_error(self, title: str, text: str) -> None:
        messagebox.showerror(title, text)

    def ask_import_path(self) -> str:
        return filedialog.askopenfilename(title="Import a kohya or OneTrainer config",
                                          filetypes=[("kohya or OneTrainer config", "*.toml *.json"), ("All", "*")])

    def show_info(self, title: str, text: str) -> None:
        messagebox.showinfo(title, text)
