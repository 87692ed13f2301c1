"""Laying out bound fields: a label with the field's tooltip, the widget, its error line."""
from __future__ import annotations

import customtkinter as ctk

from ..binding import field_choices, field_label, field_type
from .fields import ERROR_COLOR, Binder, BoundField, ChoiceField, EntryField, SwitchField, browse
from .tooltip import Tooltip


class Form:
    """A two-column grid (label | widget) on `master`, one row per field plus its error line."""

    def __init__(self, master, binder: Binder, tab: str = ""):
        self.master, self.binder = master, binder
        self.tab = tab
        """The tab the form is on: messages about its fields name it."""
        self.row = 0
        # Labels line up at a fixed width; spare width goes to column 3, right of the Browse
        # buttons, so switches (which span the columns) do not push the entries around.
        master.grid_columnconfigure(0, minsize=190)
        master.grid_columnconfigure(3, weight=1)

    def section(self, title: str) -> ctk.CTkLabel:
        label = ctk.CTkLabel(self.master, text=title, font=ctk.CTkFont(size=15, weight="bold"), anchor="w")
        label.grid(row=self.row, column=0, columnspan=4, sticky="w", padx=10, pady=(14, 2))
        self.row += 1
        return label

    def field(self, path: str, label: str | None = None, browse_kind: str | None = None,
              width: int = 260) -> BoundField:
        """The widget that fits the field: switch for bool, menu for a choice, else an entry."""
        text = label or field_label(path)
        self.binder.places.add(path, self.tab, text)
        choices = field_choices(path)
        tp = field_type(path)
        if tp is bool:
            bound = SwitchField(self.binder, path, self.master, text=text)
            bound.widget.grid(row=self.row, column=0, columnspan=4, sticky="w", padx=10, pady=3)
        else:
            caption = ctk.CTkLabel(self.master, text=text, anchor="w")
            caption.grid(row=self.row, column=0, sticky="w", padx=(10, 6), pady=3)
            if choices:
                bound = ChoiceField(self.binder, path, self.master, choices)
            else:
                bound = EntryField(self.binder, path, self.master, width=width)
            bound.widget.grid(row=self.row, column=1, sticky="w", padx=4, pady=3)
            bound.caption = caption
            Tooltip(caption, bound.tooltip_text)
            bound.row_widgets.append(caption)
            if browse_kind:
                # A field that takes a file or a folder gets a button for each: one dialog per click.
                kinds = ("file", "folder") if browse_kind == "any" else (browse_kind,)
                buttons = ctk.CTkFrame(self.master, fg_color="transparent")
                buttons.grid(row=self.row, column=2, sticky="w", padx=4)
                bound.browse_buttons = {}
                for col, kind in enumerate(kinds):
                    button = ctk.CTkButton(buttons, text="File..." if len(kinds) > 1 and kind == "file" else
                                           "Folder..." if len(kinds) > 1 else "Browse", width=70,
                                           command=lambda kind=kind: browse(self.binder, bound, kind))
                    button.grid(row=0, column=col, padx=(0, 4))
                    Tooltip(button, f"Choose a {kind} in a dialog that opens where the field's path is.")
                    bound.browse_buttons[kind] = button
                bound.row_widgets.append(buttons)
        self.row += 1
        bound.error_label = ctk.CTkLabel(self.master, text="", text_color=ERROR_COLOR, anchor="w",
                                         justify="left", wraplength=560)
        bound.error_label.grid(row=self.row, column=0, columnspan=4, sticky="w", padx=14)
        bound.error_label.grid_remove()
        self.row += 1
        return self.binder.add(bound)

    def fields(self, *paths: str) -> None:
        for path in paths:
            self.field(path)
