"""The Tools tab: merge a LoRA into its base, resize a LoRA, extract a LoRA from a fine-tune. A thin view over
`ui/lora_tools.py`: one form per tool from its `TOOLS` fields, Run and Stop, a progress bar and the result
line; the tool runs in its own process and the tab polls it with after(), so the window never waits. A form
fits the window's minimum width (760 px)."""
from __future__ import annotations

import tkinter as tk

import customtkinter as ctk

from ..lora_tools import TOOLS, LoraToolsController, ToolField
from .buttons import Button, OptionMenu
from .dialogs import start_folder
from .fields import ERROR_COLOR
from .notice_line import NoticeLine
from .tooltip import Tooltip

POLL_MS = 150
TITLES = {"merge": "Merge", "resize": "Resize", "extract": "Extract"}
DONE_COLOR = ("#1f6f3f", "#7fd49f")


class LoraToolsView(ctk.CTkScrollableFrame):
    """Scrolls, like the other tabs: the window's minimum size shows the form, Run is below the fold."""

    def __init__(self, master, dialogs, controller: LoraToolsController | None = None):
        super().__init__(master, fg_color="transparent")
        self.dialogs = dialogs
        self.controller = controller or LoraToolsController()
        self.values: dict[str, dict[str, tk.Variable]] = {}
        """Tool -> field key -> its variable (what the user typed or chose)."""
        self.forms: dict[str, ctk.CTkFrame] = {}

        self.choice = ctk.CTkSegmentedButton(self, values=[TITLES[t] for t in TOOLS], command=self._show)
        self.choice.pack(anchor="w", padx=10, pady=(10, 4))
        self.body = ctk.CTkFrame(self, fg_color="transparent")
        self.body.pack(fill="x", padx=4)
        for tool, (description, fields) in TOOLS.items():
            self.forms[tool] = self._form(tool, description, fields)

        row = ctk.CTkFrame(self, fg_color="transparent")
        row.pack(fill="x", padx=10, pady=(10, 4))
        self.run_button = Button(row, text="Run", width=100, command=self.run)
        self.run_button.pack(side="left")
        self.stop_button = Button(row, text="Stop", width=80, command=lambda: self.controller.stop(),
                                  state="disabled")
        self.stop_button.pack(side="left", padx=(8, 0))
        self.progress = ctk.CTkProgressBar(row, width=320)
        self.progress.set(0)
        self.progress.pack(side="left", padx=12)
        self.status = ctk.CTkLabel(row, text="", anchor="w")
        self.status.pack(side="left", fill="x", expand=True)
        self.result = NoticeLine(self)
        self.result.pack(fill="x", padx=10, pady=(0, 8))
        self.choice.set(TITLES["merge"])
        self._show(TITLES["merge"])
        # Closing the window ends a running tool (its output is written whole or not at all).
        self.bind("<Destroy>", lambda event: self.controller.stop() if event.widget is self else None, add="+")

    @property
    def tool(self) -> str:
        title = self.choice.get()
        return next(tool for tool, name in TITLES.items() if name == title)

    def select(self, tool: str) -> None:
        self.choice.set(TITLES[tool])
        self._show(TITLES[tool])

    def _show(self, title: str) -> None:
        for form in self.forms.values():
            form.pack_forget()
        self.forms[self.tool].pack(fill="x")

    def _form(self, tool: str, description: str, fields: tuple[ToolField, ...]) -> ctk.CTkFrame:
        form = ctk.CTkFrame(self.body, fg_color="transparent")
        ctk.CTkLabel(form, text=description, anchor="w", font=ctk.CTkFont(weight="bold")).grid(
            row=0, column=0, columnspan=4, sticky="w", padx=6, pady=(4, 8))
        variables = self.values[tool] = {}
        for row, spec in enumerate(fields, start=1):
            label = ctk.CTkLabel(form, text=spec.label, anchor="w", width=130)
            label.grid(row=row, column=0, sticky="w", padx=6, pady=3)
            if spec.tip:
                Tooltip(label, spec.tip)
            if spec.kind == "check":
                var = tk.StringVar(value=spec.default)
                widget = ctk.CTkCheckBox(form, text="", variable=var, onvalue="1", offvalue="0")
            elif spec.kind == "choice":
                var = tk.StringVar(value=spec.default)
                widget = OptionMenu(form, values=list(spec.choices), variable=var, width=120)
            else:
                var = tk.StringVar(value=spec.default)
                widths = {"number": 120}
                widget = ctk.CTkEntry(form, textvariable=var, width=widths.get(spec.kind, 380))
            widget.grid(row=row, column=1, sticky="w", padx=6, pady=3)
            if spec.tip:
                Tooltip(widget, spec.tip)
            variables[spec.key] = var
            kinds = {"model": ("File", "Folder"), "lora": ("File",), "out": ("File", "Folder"),
                     "lora_out": ("File",)}.get(spec.kind, ())
            for column, kind in enumerate(kinds, start=2):
                Button(form, text=f"{kind}...", width=70,
                       command=lambda s=spec, v=var, k=kind: self._browse(s, v, k)).grid(row=row, column=column, padx=2)
        return form

    def _browse(self, spec: ToolField, var: tk.Variable, kind: str) -> None:
        start = start_folder(var.get())
        if kind == "Folder":
            chosen = self.dialogs.ask_folder(spec.label, start)
        elif spec.kind in ("out", "lora_out"):
            chosen = self.dialogs.ask_new_file(spec.label, start)
        else:
            chosen = self.dialogs.ask_file(spec.label, start)
        if chosen:
            var.set(chosen)

    def run(self) -> None:
        tool = self.tool
        problem = self.controller.start(tool, {key: var.get() for key, var in self.values[tool].items()})
        if problem:
            self._show_state()
            return
        self.run_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        self.progress.set(0)
        self._show_state()
        self.after(POLL_MS, self._poll)

    def _poll(self) -> None:
        if not self.winfo_exists():
            return
        state = self.controller.poll()
        self._show_state()
        if state.running:
            self.after(POLL_MS, self._poll)
            return
        self.run_button.configure(state="normal")
        self.stop_button.configure(state="disabled")

    def _show_state(self) -> None:
        state = self.controller.state
        self.progress.set(1.0 if state.result and not state.running else state.fraction)
        self.status.configure(text=f"{TITLES.get(state.tool, '')}: {state.line()}" if state.running else "")
        if not state.running:
            self.result.show(state.line(), ERROR_COLOR if state.error else DONE_COLOR)
        else:
            self.result.show("", DONE_COLOR)
