"""Widgets bound to config fields by path, and the binder that keeps them in step.

Every editable widget is created here with a field path; the binder writes the widget's value
into the `ConfigModel` on every change, refreshes the widget when the model changes elsewhere,
and marks the widget red with the validation message of its field.
"""
from __future__ import annotations

import tkinter as tk
from typing import Callable

import customtkinter as ctk

from ..applicability import unused_fields
from ..binding import FieldError, field_doc
from ..config_model import ConfigModel, problems_by_field
from ..field_places import FieldPlaces
from ..field_visibility import hidden_fields
from .buttons import OptionMenu
from .dialogs import Dialogs, start_folder
from .tooltip import Tooltip

ERROR_COLOR = "#d94040"
DISABLED_TEXT = ("gray60", "gray45")
NORMAL_TEXT = ctk.ThemeManager.theme["CTkLabel"]["text_color"]


class BoundField:
    """One widget bound to one field path; subclasses choose the widget and the variable."""

    def __init__(self, binder: "Binder", path: str, var: tk.Variable, widget: ctk.CTkBaseClass):
        self.binder, self.path, self.var, self.widget = binder, path, var, widget
        self.error_label: ctk.CTkLabel | None = None
        self.caption: ctk.CTkLabel | None = None
        self.row_widgets: list = [widget]
        self.browse_buttons: dict = {}
        """The field's file / folder dialog buttons by kind ("file", "folder"), if it has any."""
        """Everything on the field's row (label, widget, Browse button), hidden together."""
        self.visible = True
        self.message = ""
        self._shown = ("", False, True)
        """(message, marked bad, visible) as the widgets show them now: as built, no message, not marked."""
        self.unused_reason: str | None = None
        """Why the current config ignores this field (the widget is disabled then), or None."""
        self._refreshing = False
        self.tooltip = Tooltip(widget, self.tooltip_text)
        var.trace_add("write", self._written)

    def tooltip_text(self) -> str:
        text = self.binder.places.describe_doc(field_doc(self.path), self.path)
        return f"{text}\n\nNot used now: {self.unused_reason}." if self.unused_reason else text

    def value_for_model(self):
        return self.var.get()

    def value_for_view(self):
        return self.binder.model.get_text(self.path)

    def refresh(self) -> None:
        value = self.value_for_view()
        if self.var.get() != value and self.path not in self.binder.type_errors:
            self._refreshing = True
            try:
                self.var.set(value)
            finally:
                self._refreshing = False

    def _written(self, *_):
        if not self._refreshing:
            self.binder.write(self.path, self.value_for_model())

    def mark(self, messages: list[str]) -> None:
        self.message = "\n".join(self.binder.places.without_field(m, self.path) for m in messages)
        # Every edit revalidates every field; redrawing the ~250 unchanged ones (customtkinter redraws a
        # widget's rounded outline on each configure) made the window's start and each edit slow.
        shown = (self.message, bool(messages), self.visible)
        if shown == self._shown:
            return
        self._shown = shown
        self.show_mark(bool(messages))
        if self.error_label is not None:
            self.error_label.configure(text=self.message)
            if messages and self.visible:
                self.error_label.grid()
            else:
                self.error_label.grid_remove()

    def set_visible(self, visible: bool) -> None:
        """Show or hide the field's row (a field that does not apply to the config is hidden)."""
        if visible == self.visible:
            return
        self.visible = visible
        for widget in self.row_widgets:
            if visible:
                widget.grid()
            else:
                widget.grid_remove()
        self.mark(self.message.splitlines() if self.message else [])

    def show_mark(self, bad: bool) -> None:
        pass

    def set_unused(self, reason: str | None) -> None:
        """Disable the widget (and grey its label) while the config ignores this field."""
        if reason == self.unused_reason:
            return
        self.unused_reason = reason
        self.widget.configure(state="disabled" if reason else "normal")
        if self.caption is not None:
            self.caption.configure(text_color=DISABLED_TEXT if reason else NORMAL_TEXT)
        self.show_unused(bool(reason))

    def show_unused(self, unused: bool) -> None:
        pass


class EntryField(BoundField):
    def __init__(self, binder, path, master, width=260):
        var = tk.StringVar(master, binder.model.get_text(path))
        entry = ctk.CTkEntry(master, textvariable=var, width=width)
        self._normal_border = entry.cget("border_color")
        self._normal_text = entry.cget("text_color")
        super().__init__(binder, path, var, entry)

    def show_mark(self, bad: bool) -> None:
        self.widget.configure(border_color=ERROR_COLOR if bad else self._normal_border)

    def show_unused(self, unused: bool) -> None:
        self.widget.configure(text_color=DISABLED_TEXT if unused else self._normal_text)


class SwitchField(BoundField):
    def __init__(self, binder, path, master, text=""):
        var = tk.BooleanVar(master, bool(binder.model.get(path)))
        switch = ctk.CTkSwitch(master, text=text, variable=var, onvalue=True, offvalue=False)
        super().__init__(binder, path, var, switch)

    def value_for_view(self):
        return bool(self.binder.model.get(self.path))


class ChoiceField(BoundField):
    def __init__(self, binder, path, master, choices, width=160):
        var = tk.StringVar(master, binder.model.get_text(path))
        menu = OptionMenu(master, values=list(choices), variable=var, width=width)
        super().__init__(binder, path, var, menu)

    def show_mark(self, bad: bool) -> None:
        self.widget.configure(text_color=ERROR_COLOR if bad else ctk.ThemeManager.theme["CTkOptionMenu"]["text_color"])


class Binder:
    """All bound widgets of the window, by field path."""

    def __init__(self, model: ConfigModel, dialogs: Dialogs | None = None):
        self.model = model
        self.dialogs = dialogs or Dialogs()
        """The window's questions and file dialogs (tests answer them)."""
        self.fields: dict[str, BoundField] = {}
        self.type_errors: dict[str, str] = {}
        """Text typed into a field that its type rejects (the config keeps the previous value)."""
        self.problems: dict[str, list[str]] = {}
        self.places = FieldPlaces()
        """Tab and label of every field, for messages that a user can find in the window."""
        self.hidden: set[str] = hidden_fields(model.cfg)
        """Fields that do not apply to the config (`ui.field_visibility`); their rows are hidden."""
        self.on_change: list[Callable[[str | None], None]] = []
        self._writing: str | None = None
        model.subscribe(self._model_changed)

    def add(self, field: BoundField) -> BoundField:
        self.fields[field.path] = field
        field.set_visible(field.path not in self.hidden or field.path in self.problems)
        return field

    def forget(self, prefix: str) -> None:
        """Drop the fields under `prefix` (a list editor rebuilding its rows)."""
        for path in [p for p in self.fields if p.startswith(prefix)]:
            del self.fields[path]
            self.type_errors.pop(path, None)

    def write(self, path: str, value) -> None:
        # The field being typed into is not refreshed from the model: "1." must not become "1.0"
        # under the user's cursor.
        self._writing = path
        unread_before = self.type_errors.get(path)
        try:
            self.model.set(path, value)
        except FieldError as e:
            self.type_errors[path] = f"{path}: {e}"
        else:
            self.type_errors.pop(path, None)
        finally:
            self._writing = None
        self.revalidate()
        if self.type_errors.get(path) != unread_before:
            # Text the field cannot take is an unsaved change too (the title's marker, closing asks).
            for listener in list(self.on_change):
                listener(path)

    @property
    def dirty(self) -> bool:
        """The config differs from its file, or a field holds text it could not take."""
        return self.model.dirty or bool(self.type_errors)

    def _model_changed(self, path: str | None) -> None:
        if path is None:
            self.type_errors.clear()
            for field in list(self.fields.values()):
                try:
                    field.refresh()
                except KeyError:
                    pass  # a row of a list that got shorter; its editor rebuilds just below
        elif path in self.fields and path != self._writing:
            self.fields[path].refresh()
        self.revalidate()
        for listener in list(self.on_change):
            listener(path)

    def revalidate(self) -> None:
        self.problems = problems_by_field(self.model.problems())
        for path, message in self.type_errors.items():
            self.problems.setdefault(path, []).insert(0, message)
        unused = unused_fields(self.model.cfg)
        self.hidden = hidden_fields(self.model.cfg)
        for path, field in self.fields.items():
            # A field with a problem stays in sight, so that the problem can be fixed there.
            field.set_visible(path not in self.hidden or path in self.problems)
            field.mark(self.problems.get(path, []))
            field.set_unused(unused.get(path))

    def all_problems(self, check_paths: bool) -> list[str]:
        """What Start must refuse: text no field accepted, then every validation problem; each names the
        tab and label of its field where the window shows it."""
        messages = list(self.type_errors.values()) + self.model.problems(check_paths=check_paths)
        return [self.places.describe(m) for m in messages]


def browse(binder: "Binder", field: BoundField, kind: str) -> None:
    """Fill `field` from one file or folder dialog (`kind`: "folder" or "file"), opened where its value is;
    Cancel leaves it as it was."""
    title = f"{binder.places.name(field.path) or field.path}: choose a {kind}"
    start = start_folder(field.var.get())
    chosen = binder.dialogs.ask_folder(title, start) if kind == "folder" else binder.dialogs.ask_file(title, start)
    if chosen:
        field.var.set(chosen)
