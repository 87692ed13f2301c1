"""The Run tab's "Run on" row: this machine, or a saved remote machine with its connection fields, the
"Check connection" button and the runs already on that machine.

Choosing a remote hands the Run tab a `RemoteRunController` for it (`RunView.use`); Start, Stop, the
commands, Continue, the plot and the log then work as for a local run. Choosing one (or reopening Tandem
with one chosen) looks up its runs and follows the newest still going from its first line. `on_machine` hears of
every choice (the chosen remote's controller, or None for this machine): the Queue tab shows that machine's queue.
"""
from __future__ import annotations

import tkinter as tk
from typing import Callable

import customtkinter as ctk

from modules.remote.host import DEFAULT_FOLDER, RemoteHost

from ..remote_controller import RemoteRunController, RemoteTensorBoard
from ..run_controller import RunController
from ..settings import SavedRemotes
from .dialogs import Dialogs
from .fields import ERROR_COLOR, Binder
from .run_view import RunView
from .tooltip import Tooltip

THIS_MACHINE = "This machine"
NEW_REMOTE = "New remote machine..."
POLL_MS = 200
FIELDS = (
    ("host", "Host", "The machine's name or address, as ssh reaches it (an alias of your ~/.ssh/config works). "
                     "user@host and host:port are split into the fields."),
    ("user", "User", "Your user name there. Empty: ssh's default (your ~/.ssh/config, else your local name)."),
    ("port", "Port", "ssh port (22 unless the machine's owner says otherwise)."),
    ("identity", "Identity key", "Your private key file for that machine (e.g. ~/.ssh/id_ed25519). Empty: ssh's "
                                 "own keys and your ssh agent. Tandem never asks for or stores passwords."),
    ("folder", "Remote folder", f"Tandem's folder there: its environment, uploads, runs and outputs (default "
                                f"{DEFAULT_FOLDER}; ~ is your home there)."),
    ("python", "Python there (optional)", "An existing Python on that machine with Tandem's packages (e.g. a conda "
                                          "environment). Empty: Tandem installs its own environment in the remote "
                                          "folder with install.sh, at this desktop's version."),
    ("torch_spec", "PyTorch (optional)", "The torch build Tandem's install there takes: a version, optionally "
                                         "followed by the address of the package index to take it from, e.g. torch==2.11.0 "
                                         "or torch==2.11.0 https://download.pytorch.org/whl/cu126 (CUDA 12.6). "
                                         "Empty: PyPI's build "
                                         "(CUDA, ~3 GB), or the CPU build (~200 MB) on a machine without an NVIDIA "
                                         "driver."),
    ("base_model", "Base model there (optional)", "A base model already on that machine (a path there): used "
                                                  "instead of uploading the config's base model."),
    ("environment", "Environment (optional)", "Variables for runs there, KEY=VALUE separated by spaces, e.g. "
                                              "NCCL_SOCKET_IFNAME=eth0."),
)
TIPS = {
    "check": "Connect and check the machine: GPUs (nvidia-smi), Python, free space, whether Tandem is installed "
             "there at this desktop's version (a Start installs or updates it). A machine not known yet shows its "
             "host key's fingerprint to accept once; a changed key is refused.",
    "save": "Keep these connection settings (in Tandem's settings folder; no password is stored - keys only).",
    "remove": "Forget this machine's settings (its runs and files there stay).",
    "show": "Follow the chosen run from its first line (the run goes on there whether you watch or not).",
    "fetch": "Fetch the run's model, samples and TensorBoard logs now, into <workspace>/remote/<machine>/ (a run "
             "that ends while shown is fetched by itself).",
}


class RemoteFrame(ctk.CTkFrame):
    def __init__(self, master, run_view: RunView, binder: Binder, dialogs: Dialogs, saved: SavedRemotes,
                 local: RunController, local_gpus: Callable[[], int],
                 controller_factory: Callable[..., RemoteRunController] = RemoteRunController,
                 on_machine: Callable[[RemoteRunController | None], None] = lambda controller: None):
        super().__init__(master)
        self.on_machine = on_machine
        self.run_view, self.binder, self.dialogs, self.saved = run_view, binder, dialogs, saved
        self.local, self.local_gpus, self.local_tensorboard = local, local_gpus, run_view.tensorboard
        self.factory = controller_factory
        self.controllers: dict[str, RemoteRunController] = {}
        self.current: RemoteRunController | None = None
        self.unsaved = False
        self._filling = False
        self._attach_after: int | None = None
        """Attach to a run still going there once a run listing newer than this count arrives."""
        self._asked: object = None
        self._changes_shown = -1

        top = ctk.CTkFrame(self, fg_color="transparent")
        top.grid(row=0, column=0, sticky="we", padx=8, pady=(6, 2))
        ctk.CTkLabel(top, text="Run on").pack(side="left", padx=(2, 6))
        self.menu = ctk.CTkOptionMenu(top, values=self._choices(), width=300, command=self.choose,
                                      dynamic_resizing=False)
        self.menu.pack(side="left")
        self.check_button = ctk.CTkButton(top, text="Check connection", width=140, command=self.check_connection)
        self.save_button = ctk.CTkButton(top, text="Save", width=70, command=self.save_remote)
        self.remove_button = ctk.CTkButton(top, text="Remove", width=80, fg_color="gray40", command=self.remove_remote)
        for button, tip in ((self.check_button, "check"), (self.save_button, "save"), (self.remove_button, "remove")):
            button.pack(side="left", padx=(6, 0))
            Tooltip(button, TIPS[tip])

        self.fields = ctk.CTkFrame(self, fg_color="transparent")
        self.fields.grid(row=1, column=0, sticky="we", padx=8)
        self.vars: dict[str, tk.StringVar] = {}
        self.entries: dict[str, ctk.CTkEntry] = {}
        self._cells: list[tuple[ctk.CTkLabel, ctk.CTkEntry]] = []
        self._columns = 0
        for name, label, tip in FIELDS:
            text = ctk.CTkLabel(self.fields, text=label, anchor="w")
            var = tk.StringVar(self, "")
            entry = ctk.CTkEntry(self.fields, textvariable=var, width=200 if name != "port" else 70)
            self._cells.append((text, entry))
            for widget in (text, entry):
                Tooltip(widget, tip)
            var.trace_add("write", lambda *_a: self._edited())
            self.vars[name], self.entries[name] = var, entry
        self._arrange_fields(3)
        # As many label-and-field pairs side by side as the window's width takes (three were cut off at 1024 px).
        self.bind("<Configure>", lambda event: self._arrange_fields(self._columns_that_fit(event.width)), add="+")

        runs = ctk.CTkFrame(self, fg_color="transparent")
        runs.grid(row=2, column=0, sticky="we", padx=8, pady=2)
        self.runs_row = runs
        ctk.CTkLabel(runs, text="Runs there").pack(side="left", padx=(2, 6))
        self.runs_menu = ctk.CTkOptionMenu(runs, values=["(none)"], width=420, dynamic_resizing=False)
        self.runs_menu.pack(side="left")
        self.show_button = ctk.CTkButton(runs, text="Show", width=70, command=self.show_run)
        self.fetch_button = ctk.CTkButton(runs, text="Fetch outputs", width=120, fg_color="gray40",
                                          command=self.fetch_outputs)
        for button, tip in ((self.show_button, "show"), (self.fetch_button, "fetch")):
            button.pack(side="left", padx=(6, 0))
            Tooltip(button, TIPS[tip])
        self.notice = ctk.CTkTextbox(self, height=64, wrap="word")
        self.notice.grid(row=3, column=0, sticky="we", padx=10, pady=(2, 6))
        self.grid_columnconfigure(0, weight=1)

        chosen = self.saved.find(self.saved.chosen) if self.saved.chosen else None
        if chosen is not None:
            self.menu.set(self._label(chosen))
            self._use_remote(chosen, look=True)
        else:
            self.menu.set(THIS_MACHINE)
            self._show_local()
        self.after(POLL_MS, self._tick)

    # --- the connection fields' layout -------------------------------------------------------------------
    def _columns_that_fit(self, width: int) -> int:
        label = max(text.winfo_reqwidth() for text, _ in self._cells) + 6
        entry = max(field.winfo_reqwidth() for _, field in self._cells) + 12
        return max(1, min(3, (width - 24) // (label + entry)))

    def _arrange_fields(self, columns: int) -> None:
        if columns == self._columns:
            return
        self._columns = columns
        for i, (text, entry) in enumerate(self._cells):
            row, col = divmod(i, columns)
            text.grid(row=row, column=2 * col, sticky="w", padx=(2, 4), pady=2)
            entry.grid(row=row, column=2 * col + 1, sticky="w", padx=(0, 12), pady=2)

    # --- choices ------------------------------------------------------------------------------------
    @staticmethod
    def _label(host: RemoteHost) -> str:
        return host.label + ("" if host.folder == DEFAULT_FOLDER else f"  ({host.folder})")

    def _choices(self) -> list[str]:
        return [THIS_MACHINE] + [self._label(h) for h in self.saved.hosts] + [NEW_REMOTE]

    def choose(self, choice: str) -> None:
        if choice == THIS_MACHINE:
            self.saved.choose("")
            self._show_local()
            return
        if choice == NEW_REMOTE:
            blank = RemoteHost(host="")
            self._fill(blank)
            self.current = None
            self._show_fields(True)
            # Start refuses (no machine yet) instead of training here or on the machine shown before.
            placeholder = self.factory(blank, self.saved.known_hosts(), python=self.local.python)
            self.run_view.use(placeholder, RemoteTensorBoard(placeholder), placeholder.visible_gpus)
            self.on_machine(placeholder)
            self._say("Fill in the machine, then Check connection (which saves it).")
            return
        host = next(h for h in self.saved.hosts if self._label(h) == choice)
        self.saved.choose(host.key)
        self._use_remote(host, look=True)

    def _show_local(self) -> None:
        self.current = None
        self._show_fields(False)
        self.run_view.use(self.local, self.local_tensorboard, self.local_gpus)
        self.on_machine(None)

    def _show_fields(self, shown: bool) -> None:
        for widget in (self.fields, self.runs_row, self.notice):
            widget.grid() if shown else widget.grid_remove()
        for button in (self.check_button, self.save_button, self.remove_button):
            button.configure(state="normal" if shown else "disabled")

    def _use_remote(self, host: RemoteHost, look: bool) -> None:
        self._fill(host)
        self._show_fields(True)
        controller = self.controllers.get(host.key)
        if controller is None or controller.host != host:
            if controller is not None and not controller.state.active:
                controller.detach()
            controller = self.factory(host, self.saved.known_hosts(), python=self.local.python)
            self.controllers[host.key] = controller
        self.current = controller
        self.run_view.use(controller, RemoteTensorBoard(controller), controller.visible_gpus)
        self.on_machine(controller)
        if look:
            self._attach_after = controller.listed if not controller.state.active else None
            controller.refresh()
            if controller.report is None:
                controller.check()  # its GPUs decide what Start runs
            self._say(f"Looking for runs on {host.label}...")

    def _fill(self, host: RemoteHost) -> None:
        self._filling = True
        for name, var in self.vars.items():
            value = getattr(host, name)
            var.set("" if value is None else str(value))
        self._filling = False
        self.unsaved = False

    def _edited(self) -> None:
        if self._filling or self.unsaved:
            return
        self.unsaved = True
        if self.current is not None:
            self._say("Changed: Save (or Check connection) to use these settings; Start uses the saved ones.")

    def host_from_fields(self) -> RemoteHost:
        """The settings as typed; raises ValueError with what is wrong."""
        values = {name: var.get().strip() for name, var in self.vars.items()}
        host = RemoteHost.from_dict({**values, "port": int(values["port"] or 22), "folder": values["folder"] or DEFAULT_FOLDER})
        if "@" in host.host or host.host.count(":") == 1:
            host = host.with_destination(host.host)
        problems = host.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return host

    # --- buttons ------------------------------------------------------------------------------------
    def save_remote(self) -> RemoteHost | None:
        try:
            host = self.host_from_fields()
        except ValueError as e:
            self._say(str(e), error=True)
            return None
        replacing = self.current.host.key if self.current is not None else None
        if self.current is not None and self.current.state.active and self.current.host != host:
            self._say("A run is shown from this machine: change its settings once it has ended (it goes on there "
                      "whatever you change here).", error=True)
            return None
        self.saved.save(host, replacing)
        self.menu.configure(values=self._choices())
        self.menu.set(self._label(host))
        if self.current is None or self.current.host != host:
            self._use_remote(host, look=False)
        self.unsaved = False
        return host

    def remove_remote(self) -> None:
        if self.current is None or self.current.state.active:
            return
        self.saved.remove(self.current.host.key)
        self.controllers.pop(self.current.host.key, None)
        self.menu.configure(values=self._choices())
        self.menu.set(THIS_MACHINE)
        self._show_local()

    def check_connection(self) -> None:
        if self.save_remote() is None or self.current is None:
            return
        self._say(f"Checking {self.current.host.label}...")
        self.current.check()

    def show_run(self) -> None:
        controller = self.current
        if controller is None:
            return
        chosen = self.runs_menu.get().split(" ", 1)[0]
        run = controller.choose_run(chosen, None)
        if run is None:
            self._say("No run chosen", error=True)
            return
        controller.attach(run, instead=True)  # a run shown before goes on there, unwatched

    def fetch_outputs(self) -> None:
        if self.current is not None:
            self.current.fetch(self.binder.model.cfg)
            self._say("Fetching the outputs...")

    # --- following the controller ----------------------------------------------------------------
    def _tick(self) -> None:
        try:
            self._follow_controller()
        finally:
            self.after(POLL_MS, self._tick)

    def _follow_controller(self) -> None:
        controller = self.current
        if controller is None:
            return
        if controller.changes != self._changes_shown:
            self._changes_shown = controller.changes
            self.run_view.redraw()
        if controller.unknown_keys and self._asked is not controller.unknown_keys:
            keys = controller.unknown_keys
            self._asked = keys
            shown = "\n".join(f"  {k.describe()}" for k in keys)
            if self.dialogs.ask_yes_no("Unknown machine", (
                    f"{controller.host.label} is not known yet. It offers these host keys:\n{shown}\n\nCompare them "
                    "with `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the machine (or ask its owner). "
                    "Trust this machine from now on?")):
                controller.trust(keys)
            else:
                controller.unknown_keys = None
                self._say("Not connected: the host key was not accepted.", error=True)
        question = controller.question
        if question is not None and self._asked is not question:
            self._asked = question
            controller.answer(self.dialogs.ask_yes_no("Large upload", question.text))
        if controller.notice and controller.notice != self._shown_notice():
            self._say(controller.notice, error=controller.notice_error)
        labels = [r.describe() for r in reversed(controller.runs)] or ["(none)"]
        if list(self.runs_menu.cget("values")) != labels:
            self.runs_menu.configure(values=labels)
            self.runs_menu.set(labels[0])
        if self._attach_after is not None and controller.listed > self._attach_after:
            self._attach_after = None
            run = controller.choose_run(None, self.binder.model.cfg)  # this workspace's, else any still going
            if run is None or not run.active:
                run = controller.choose_run(None, None)
            if run is not None and run.active and not controller.state.active:
                controller.attach(run)
                self._say(f"{run.id} is still going on {controller.host.label}: shown from its first line.")

    def _shown_notice(self) -> str:
        return self.notice.get("1.0", "end").strip()

    def _say(self, text: str, error: bool = False) -> None:
        self.notice.configure(state="normal", text_color=ERROR_COLOR if error else ("gray10", "gray90"))
        self.notice.delete("1.0", "end")
        self.notice.insert("1.0", text)
        self.notice.configure(state="disabled")

    def notice_text(self) -> str:
        return self._shown_notice()

    def detach_all(self) -> None:
        """The window closes: stop following every remote run (they go on there) and close tunnels."""
        for controller in self.controllers.values():
            controller.detach()

