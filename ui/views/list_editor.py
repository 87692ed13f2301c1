"""Editing a list of sections (data concepts, sample prompts): one row of bound fields per item."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import customtkinter as ctk

from ..binding import field_choices, field_doc, field_type, get_value
from .dialogs import start_folder
from .fields import ERROR_COLOR, Binder, ChoiceField, EntryField, SwitchField
from .horizontal_scroller import HorizontalScroller
from .tooltip import Tooltip


class ListEditor(ctk.CTkFrame):
    """Rows for `list_path` (e.g. `data.concepts`); `columns` are (field name, header, width). A field that
    declares choices (`data.concepts[].role`) gets a drop-down, a bool a switch, any other an entry."""

    def __init__(self, master, binder: Binder, list_path: str, tab: str, row_name: str,
                 columns: list[tuple[str, str, int]], new_item: Callable[[], Any | None], add_text: str,
                 pickers: dict[str, tuple[str, str]] | None = None,
                 shown_when: dict[str, Callable[[Any], bool]] | None = None):
        """`pickers`: field name -> (button text, `folder` or `image`): a button on each row that fills that
        column from a folder or image dialog. `shown_when`: field name -> whether the config uses that column
        (a column most configs do not use stays out of the row, which then fits the window)."""
        super().__init__(master, fg_color="transparent")
        self.binder, self.all_columns, self.new_item = binder, columns, new_item
        self.list_path = list_path
        self.all_pickers, self.shown_when = pickers or {}, shown_when or {}
        self.columns, self.pickers = self._shown_columns()
        # Messages name a row's field as "Data › Concepts, row 2 › Repeats".
        binder.places.add(list_path, tab, row_name)
        for name, header, _ in columns:
            binder.places.add(f"{list_path}[0].{name}", tab, header)
        self.rows: list[list[ctk.CTkBaseClass]] = []
        self.grid_columnconfigure(0, weight=1)
        # Rows may be wider than the window (many columns): they scroll sideways, header and all.
        self.scroller = HorizontalScroller(self)
        self.scroller.grid(row=0, column=0, sticky="we")
        self.header = ctk.CTkFrame(self.scroller.content, fg_color="transparent")
        self.header.grid(row=0, column=0, sticky="w")
        self.body = ctk.CTkFrame(self.scroller.content, fg_color="transparent")
        self.body.grid(row=1, column=0, sticky="w")
        self.message = ctk.CTkLabel(self, text="", text_color=ERROR_COLOR, anchor="w")
        self.message.grid(row=1, column=0, sticky="w", padx=4)
        self.add_button = ctk.CTkButton(self, text=add_text, width=160, command=self.add)
        self.add_button.grid(row=2, column=0, sticky="w", padx=4, pady=6)
        self.header_labels: list[ctk.CTkLabel] = []
        self._count = -1
        binder.on_change.append(self._changed)
        self.rebuild()

    def items(self) -> list:
        return get_value(self.binder.model.cfg, self.list_path)

    def _shown_columns(self) -> tuple[list[tuple[str, str, int]], dict[str, tuple[str, str]]]:
        cfg = self.binder.model.cfg
        columns = [c for c in self.all_columns if c[0] not in self.shown_when or self.shown_when[c[0]](cfg)]
        names = {name for name, _, _ in columns}
        return columns, {name: picker for name, picker in self.all_pickers.items() if name in names}

    def _changed(self, path: str | None) -> None:
        if (path is None and len(self.items()) != self._count) or self._shown_columns()[0] != self.columns:
            self.rebuild()
        self.message.configure(text="\n".join(self.binder.problems.get(self.list_path, [])))

    def _build_header(self) -> None:
        for label in self.header_labels:
            label.destroy()
        self.header_labels = []
        for col, (name, header, width) in enumerate(self.columns):
            label = ctk.CTkLabel(self.header, text=header, width=width, anchor="w")
            label.grid(row=0, column=col, padx=4, sticky="w")
            path = f"{self.list_path}[0].{name}"
            Tooltip(label, lambda path=path: self.binder.places.describe_doc(field_doc(path), path))
            self.header_labels.append(label)

    def rebuild(self) -> None:
        self.columns, self.pickers = self._shown_columns()
        self._build_header()
        self.binder.forget(self.list_path + "[")
        for row in self.rows:
            for widget in row:
                widget.destroy()
        self.rows = []
        for index in range(len(self.items())):
            self.rows.append(self._row(index))
        self._count = len(self.items())
        self.binder.revalidate()

    def _row(self, index: int) -> list[ctk.CTkBaseClass]:
        widgets: list[ctk.CTkBaseClass] = []
        for col, (name, _, width) in enumerate(self.columns):
            path = f"{self.list_path}[{index}].{name}"
            choices = field_choices(path)
            if choices:
                field = ChoiceField(self.binder, path, self.body, choices, width=width)
            elif field_type(path) is bool:
                field = SwitchField(self.binder, path, self.body, text="")
                field.widget.configure(width=width)
            else:
                field = EntryField(self.binder, path, self.body, width=width)
            field.widget.grid(row=index, column=col, padx=4, pady=2, sticky="w")
            self.binder.add(field)
            widgets.append(field.widget)
        col = len(self.columns)
        for name, (text, kind) in self.pickers.items():
            button = ctk.CTkButton(self.body, text=text, width=64 if len(text) < 10 else 80,
                                   command=lambda i=index, n=name: self.choose(i, n))
            button.grid(row=index, column=col, padx=4)
            header = next(h for n, h, _ in self.columns if n == name)
            Tooltip(button, f"Choose this row's {header.lower()} in a dialog ({'a folder' if kind == 'folder' else 'an image'}).")
            widgets.append(button)
            col += 1
        remove = ctk.CTkButton(self.body, text="Remove", width=70, fg_color="gray40",
                               command=lambda i=index: self.remove(i))
        remove.grid(row=index, column=col, padx=4)
        widgets.append(remove)
        return widgets

    def choose(self, index: int, name: str) -> None:
        """Fill row `index`'s `name` from its dialog."""
        field = self.binder.fields[f"{self.list_path}[{index}].{name}"]
        title = self.binder.places.name(field.path) or field.path
        ask = self.binder.dialogs.ask_folder if self.pickers[name][1] == "folder" else self.binder.dialogs.ask_image
        # A concept's control folder is relative to the concept's folder; a list (`control_1, control_2`) opens
        # at its first entry.
        base = getattr(self.items()[index], "path", "") if name != "path" else ""
        base = Path(base).expanduser() if base and not base.startswith("builtin:") else None
        current = field.var.get().split(",")[0].strip()
        if base is not None and current and not Path(current).expanduser().is_absolute():
            current = str(base / current)
        chosen = ask(title, start_folder(current or (str(base) if base else "")))
        if chosen:
            if base is not None and Path(chosen).is_relative_to(base.absolute()):
                chosen = Path(chosen).relative_to(base.absolute()).as_posix() or chosen
            field.var.set(chosen)

    def add(self, item: Any | None = None) -> None:
        """Append `item`, or what `new_item()` makes (it may ask the user and return None)."""
        item = item if item is not None else self.new_item()
        if item is not None:
            self.binder.model.replace_list(lambda cfg: get_value(cfg, self.list_path).append(item))

    def remove(self, index: int) -> None:
        self.binder.model.replace_list(lambda cfg: get_value(cfg, self.list_path).pop(index))
