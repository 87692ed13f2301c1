"""The caption editor window of one concept (the Data tab's "Captions..." per concept): thumbnails a page at a
time with their captions, one caption's edit, bulk add / remove / find-and-replace shown before they are
written (with an undo of the last), tag counts, the images without a caption, and auto-captioning from a
local model. The state and every rule are `ui/caption_controller.py`; reading the folder and the thumbnails
happen off the Tk thread (`background.in_background`), so a large folder never freezes the window."""
from __future__ import annotations

import sys
from typing import Callable

import customtkinter as ctk

from ..caption_controller import AutoCaptionRun, CaptionEditorState, CaptionSource, thumbnail
from .background import in_background
from .dialogs import start_folder
from .fields import ERROR_COLOR
from .tooltip import Tooltip

COLUMNS = 4
MISSING_COLOR = ("#b35c00", "#f0a050")
SELECTED_COLOR = ("#3a7ebf", "#1f6aa5")
POLL_MS = 200
_last_model = {"folder": ""}
"""The captioning model folder last used in this session (offered again by the next editor)."""


def _text_color():
    return ctk.ThemeManager.theme["CTkLabel"]["text_color"]


class CaptionEditor(ctk.CTkToplevel):
    def __init__(self, master, source: CaptionSource, dialogs, gpu_count: Callable[[], int] = lambda: 0,
                 python: str = sys.executable):
        super().__init__(master)
        self.title(f"Captions - {source.name or source.folder}")
        self.geometry("1080x780")
        self.captions = CaptionEditorState(source)
        self.source, self.dialogs, self.gpu_count, self.python = source, dialogs, gpu_count, python
        self.selected: int | None = None
        self._in_box = ""
        """The chosen image's caption as the box was filled with it."""
        self.loaded = False
        """True once the folder was read (tests wait for it)."""
        self.thumbs_ready = False
        """True once the shown page's thumbnails are in (tests wait for it)."""
        self.run: AutoCaptionRun | None = None
        self._images: list[ctk.CTkImage] = []
        self._page_token = 0
        self.tiles: list[ctk.CTkButton] = []
        self.grid_columnconfigure(0, weight=1)
        self.grid_rowconfigure(2, weight=1)
        self._build_header()
        self._build_body()
        self._build_bulk_row()
        self._build_auto_row()
        self.protocol("WM_DELETE_WINDOW", self.close)
        self.after(50, self._raise)
        self.reload()

    def _raise(self) -> None:
        self.lift()
        self.focus_force()

    # --- layout -------------------------------------------------------------------------------
    def _build_header(self) -> None:
        head = ctk.CTkFrame(self, fg_color="transparent")
        head.grid(row=0, column=0, sticky="we", padx=10, pady=(10, 0))
        ctk.CTkLabel(head, text=self.source.folder, anchor="w", font=ctk.CTkFont(weight="bold")).pack(side="left")
        self.summary = ctk.CTkLabel(head, text="Reading the folder...", anchor="w", text_color="gray60")
        self.summary.pack(side="left", padx=12)
        bar = ctk.CTkFrame(self, fg_color="transparent")
        bar.grid(row=1, column=0, sticky="we", padx=10, pady=6)
        ctk.CTkLabel(bar, text="Show captions with").pack(side="left")
        self.filter_var = ctk.StringVar()
        self.filter_entry = ctk.CTkEntry(bar, textvariable=self.filter_var, width=180, placeholder_text="any text")
        self.filter_entry.pack(side="left", padx=6)
        self.filter_entry.bind("<Return>", lambda _e: self.apply_filter())
        self.missing_var = ctk.BooleanVar(value=False)
        self.missing_box = ctk.CTkCheckBox(bar, text="Only images without a caption", variable=self.missing_var,
                                           command=self.apply_filter)
        self.missing_box.pack(side="left", padx=6)
        ctk.CTkButton(bar, text="Filter", width=60, command=self.apply_filter).pack(side="left", padx=4)
        self.next_button = ctk.CTkButton(bar, text="Next ›", width=70, command=lambda: self.turn(1))
        self.next_button.pack(side="right")
        self.page_label = ctk.CTkLabel(bar, text="", width=110)
        self.page_label.pack(side="right")
        self.prev_button = ctk.CTkButton(bar, text="‹ Previous", width=80, command=lambda: self.turn(-1))
        self.prev_button.pack(side="right")

    def _build_body(self) -> None:
        body = ctk.CTkFrame(self, fg_color="transparent")
        body.grid(row=2, column=0, sticky="nswe", padx=10)
        body.grid_columnconfigure(0, weight=3)
        body.grid_columnconfigure(1, weight=2)
        body.grid_rowconfigure(0, weight=1)
        self.grid_frame = ctk.CTkScrollableFrame(body, label_text="")
        self.grid_frame.grid(row=0, column=0, sticky="nswe", padx=(0, 8))
        side = ctk.CTkFrame(body)
        side.grid(row=0, column=1, sticky="nswe")
        side.grid_columnconfigure(0, weight=1)
        self.name_label = ctk.CTkLabel(side, text="Choose an image", anchor="w")
        self.name_label.grid(row=0, column=0, sticky="we", padx=8, pady=(8, 2))
        self.caption_box = ctk.CTkTextbox(side, height=110, wrap="word")
        self.caption_box.grid(row=1, column=0, sticky="we", padx=8)
        buttons = ctk.CTkFrame(side, fg_color="transparent")
        buttons.grid(row=2, column=0, sticky="we", padx=8, pady=4)
        self.save_button = ctk.CTkButton(buttons, text="Save caption", width=110, command=self.save_caption)
        self.save_button.pack(side="left")
        Tooltip(self.save_button, "Write this caption file (written whole: a crash never leaves half a file).")
        self.message = ctk.CTkLabel(side, text="", anchor="w", justify="left", wraplength=380)
        self.message.grid(row=3, column=0, sticky="we", padx=8)
        ctk.CTkLabel(side, text="Tags (caption files holding each)", anchor="w").grid(row=4, column=0, sticky="we",
                                                                                      padx=8, pady=(8, 0))
        self.tags_box = ctk.CTkTextbox(side, height=150, wrap="word")
        self.tags_box.grid(row=5, column=0, sticky="nswe", padx=8, pady=(0, 8))
        side.grid_rowconfigure(5, weight=1)

    def _build_bulk_row(self) -> None:
        row = ctk.CTkFrame(self)
        row.grid(row=3, column=0, sticky="we", padx=10, pady=(8, 0))
        ctk.CTkLabel(row, text="Tag or text").grid(row=0, column=0, padx=(8, 4), pady=6)
        self.bulk_var = ctk.StringVar()
        ctk.CTkEntry(row, textvariable=self.bulk_var, width=160, placeholder_text="e.g. sks").grid(row=0, column=1)
        ctk.CTkLabel(row, text="Replace with").grid(row=0, column=2, padx=(10, 4))
        self.replace_var = ctk.StringVar()
        ctk.CTkEntry(row, textvariable=self.replace_var, width=130).grid(row=0, column=3)
        self.whole_var = ctk.BooleanVar(value=False)
        ctk.CTkCheckBox(row, text="Whole tags", variable=self.whole_var, width=90).grid(row=0, column=4, padx=8)
        self.bulk_buttons = {}
        for col, (action, text, tip) in enumerate((
                ("add_first", "Add first", "Put the tag first in every shown caption that lacks it (a trigger word)."),
                ("add_last", "Add last", "Put the tag last in every shown caption that lacks it."),
                ("remove", "Remove tag", "Take the tag out of every shown caption (whole tags only)."),
                ("replace", "Replace", "Replace the text (or, with Whole tags, the tag) in every shown caption."))):
            button = ctk.CTkButton(row, text=text, width=84, command=lambda a=action: self.plan(a))
            button.grid(row=0, column=5 + col, padx=3)
            Tooltip(button, tip + " Shows how many files change; Apply writes them.")
            self.bulk_buttons[action] = button
        self.plan_label = ctk.CTkLabel(row, text="Bulk edits act on the images shown, and on caption files "
                                                 "only: an image without one keeps training on its file name.",
                                       anchor="w", justify="left", wraplength=640)
        self.plan_label.grid(row=1, column=0, columnspan=7, sticky="w", padx=8, pady=(0, 6))
        self.apply_button = ctk.CTkButton(row, text="Apply", width=84, state="disabled", command=self.apply_plan)
        self.apply_button.grid(row=1, column=7, padx=3, pady=(0, 6))
        self.undo_button = ctk.CTkButton(row, text="Undo last", width=84, state="disabled", fg_color="gray40",
                                         command=self.undo)
        self.undo_button.grid(row=1, column=8, padx=3, pady=(0, 6))
        Tooltip(self.undo_button, "Put back what the last bulk edit changed (files edited since are left alone).")

    def _build_auto_row(self) -> None:
        row = ctk.CTkFrame(self)
        row.grid(row=4, column=0, sticky="we", padx=10, pady=8)
        row.grid_columnconfigure(1, weight=1)
        ctk.CTkLabel(row, text="Captioning model").grid(row=0, column=0, padx=(8, 4), pady=6)
        self.model_var = ctk.StringVar(value=_last_model["folder"])
        ctk.CTkEntry(row, textvariable=self.model_var, placeholder_text="a local BLIP, Florence-2 or Qwen2-VL folder"
                     ).grid(row=0, column=1, sticky="we")
        ctk.CTkButton(row, text="Folder...", width=70, command=self.choose_model).grid(row=0, column=2, padx=4)
        ctk.CTkLabel(row, text="Prefix").grid(row=0, column=3, padx=(8, 4))
        self.prefix_var = ctk.StringVar()
        ctk.CTkEntry(row, textvariable=self.prefix_var, width=90, placeholder_text="trigger").grid(row=0, column=4)
        self.overwrite_var = ctk.BooleanVar(value=False)
        ctk.CTkCheckBox(row, text="Replace existing", variable=self.overwrite_var, width=110).grid(row=0, column=5,
                                                                                                 padx=8)
        self.auto_button = ctk.CTkButton(row, text="Auto-caption", width=110, command=self.toggle_auto)
        self.auto_button.grid(row=0, column=6, padx=(0, 8))
        Tooltip(self.auto_button, "Write a caption for each image without one (all with Replace existing), from the "
                                  "model folder: read from disk only, nothing is downloaded. With several GPUs each "
                                  "captions its share.")
        self.progress = ctk.CTkProgressBar(row)
        self.progress.set(0)
        self._progress_place = dict(row=1, column=0, columnspan=2, sticky="we", padx=8, pady=(0, 6))
        self.auto_status = ctk.CTkLabel(row, text="", anchor="w")
        self.auto_status.grid(row=1, column=2, columnspan=5, sticky="we", padx=8, pady=(0, 6))

    # --- reading and pages --------------------------------------------------------------------
    def reload(self) -> None:
        self.loaded = False
        self.summary.configure(text="Reading the folder...")

        def work() -> str:
            try:
                self.captions.load()
            except (ValueError, OSError) as error:  # CaptionEditError is a ValueError
                return str(error)
            return ""

        in_background(self, work, self._loaded, name="tandem-captions-read")

    def _loaded(self, problem: str) -> None:
        self.loaded = True
        if problem:
            self.summary.configure(text=problem, text_color=ERROR_COLOR)
            return
        if self.selected is not None and self.selected >= len(self.captions.entries):
            self.selected = None
        self.show_page()

    def apply_filter(self) -> None:
        self.captions.set_filter(self.filter_var.get(), self.missing_var.get())
        self._show_plan("")
        self.show_page()

    def turn(self, by: int) -> None:
        self.captions.turn(by)
        self.show_page()

    def show_page(self) -> None:
        """The shown page's tiles now, with their thumbnails once they are read (off the Tk thread)."""
        for tile in self.tiles:
            tile.master.destroy()
        self.tiles = []
        indexes = self.captions.page_indexes()
        for n, index in enumerate(indexes):
            self.tiles.append(self._tile(n, index))
        self.page_label.configure(text=f"Page {self.captions.page + 1} of {self.captions.pages()}")
        self.summary.configure(text=self.captions.summary(), text_color="gray60")
        self._show_tags()
        self.thumbs_ready = False
        self._page_token += 1
        token, paths = self._page_token, [self.captions.entries[i].image for i in indexes]
        in_background(self, lambda: [thumbnail(p) for p in paths], lambda pictures: self._thumbs(token, pictures),
                      name="tandem-captions-thumbs")

    def _tile(self, n: int, index: int) -> ctk.CTkButton:
        entry = self.captions.entries[index]
        cell = ctk.CTkFrame(self.grid_frame, fg_color="transparent")
        cell.grid(row=n // COLUMNS, column=n % COLUMNS, padx=4, pady=4, sticky="n")
        tile = ctk.CTkButton(cell, text=entry.image.name if not entry.is_image else "", width=120, height=120,
                             fg_color=SELECTED_COLOR if index == self.selected else "gray25",
                             command=lambda i=index: self.select(i))
        tile.pack()
        text = entry.text if entry.has_caption else f"no caption (trains on \"{entry.text}\")"
        ctk.CTkLabel(cell, text=text[:90] + ("..." if len(text) > 90 else ""), wraplength=124, width=124,
                     justify="left", anchor="w", font=ctk.CTkFont(size=11),
                     text_color=_text_color() if entry.has_caption else MISSING_COLOR).pack()
        tile.index = index
        return tile

    def _thumbs(self, token: int, pictures: list) -> None:
        if token != self._page_token:
            return  # the page changed meanwhile
        images = []
        for tile, picture in zip(self.tiles, pictures):
            if picture is not None:
                image = ctk.CTkImage(light_image=picture, dark_image=picture, size=picture.size)
                tile.configure(image=image)
                images.append(image)
        self._images = images
        self.thumbs_ready = True

    def _show_tags(self) -> None:
        counts = self.captions.tag_counts()
        missing = self.captions.missing_names()
        lines = [f"{tag}  ({count})" for tag, count in counts]
        if missing:
            lines.append(f"\nWithout a caption ({len(missing)}): " + ", ".join(missing[:30]) +
                         (", ..." if len(missing) > 30 else ""))
        self.tags_box.configure(state="normal")
        self.tags_box.delete("1.0", "end")
        self.tags_box.insert("1.0", "\n".join(lines) or "No tags yet.")
        self.tags_box.configure(state="disabled")

    # --- one caption --------------------------------------------------------------------------
    def select(self, index: int) -> None:
        """Show image `index`'s caption for editing; a caption typed for the previous one is saved first when
        the user says so (and kept in the box when its save fails)."""
        if not self._kept_typing():
            return
        self.selected = index
        entry = self.captions.entries[index]
        for tile in self.tiles:
            tile.configure(fg_color=SELECTED_COLOR if tile.index == index else "gray25")
        self.name_label.configure(text=entry.image.name + ("" if entry.has_caption else "  (no caption file yet)"))
        self._fill_box()
        self.message.configure(text="")

    def _fill_box(self) -> None:
        entry = self.captions.entries[self.selected]
        self._in_box = entry.text if entry.has_caption else ""
        self.caption_box.delete("1.0", "end")
        self.caption_box.insert("1.0", self._in_box)

    def typed(self) -> bool:
        """Whether the caption box holds text the user typed and did not save."""
        return self.selected is not None and self.caption_box.get("1.0", "end-1c").strip() != self._in_box.strip()

    def _kept_typing(self) -> bool:
        """Ask about an unsaved caption; False when saving it failed (the text stays in the box)."""
        if not self.typed():
            return True
        name = self.captions.entries[self.selected].image.name
        if not self.dialogs.ask_yes_no("Unsaved caption", f"Save the caption you typed for {name}?"):
            return True
        return self.save_caption()

    def save_caption(self) -> bool:
        if self.selected is None:
            self.message.configure(text="Choose an image first.", text_color=ERROR_COLOR)
            return False
        ok, line = self.captions.save(self.selected, self.caption_box.get("1.0", "end-1c"))
        self.message.configure(text=line, text_color=_text_color() if ok else ERROR_COLOR)
        self._refresh()
        return ok

    def message_text(self) -> str:
        return self.message.cget("text")

    # --- bulk edits ---------------------------------------------------------------------------
    def plan(self, action: str) -> None:
        self._show_plan(self.captions.plan(action, self.bulk_var.get(), self.replace_var.get(), self.whole_var.get()))

    def _show_plan(self, line: str) -> None:
        self.plan_label.configure(text=line)
        self.apply_button.configure(state="normal" if self.captions.pending is not None else "disabled")

    def plan_text(self) -> str:
        return self.plan_label.cget("text")

    def apply_plan(self) -> None:
        self._show_plan(self.captions.apply())
        self._refresh()

    def undo(self) -> None:
        self._show_plan(self.captions.undo())
        self._refresh()

    def _refresh(self) -> None:
        """After a write: the tiles, and the chosen caption as it is on disk now (unless the user is typing
        in it), so that a later Save never puts back what a bulk edit changed."""
        self.undo_button.configure(state="normal" if self.captions.last_edit is not None else "disabled")
        if self.selected is not None and not self.typed():
            self._fill_box()
        self.show_page()

    # --- auto-captioning ----------------------------------------------------------------------
    def choose_model(self) -> None:
        chosen = self.dialogs.ask_folder("Captioning model folder", start_folder(self.model_var.get()))
        if chosen:
            self.model_var.set(chosen)

    def toggle_auto(self) -> None:
        if self.run is not None and not self.run.finished:
            self.run.stop()
            return
        model = self.model_var.get().strip()
        if not model:
            self.auto_status.configure(text="Choose the captioning model's folder first.", text_color=ERROR_COLOR)
            return
        _last_model["folder"] = model
        self.run = AutoCaptionRun(self.source, model, self.prefix_var.get(), self.overwrite_var.get(),
                                  max(1, self.gpu_count()), self.python)
        self.run.start()
        self.auto_button.configure(text="Stop")
        self.progress.set(0)
        self.progress.grid(**self._progress_place)  # shown from the first run on
        self._poll()

    def _poll(self) -> None:
        run = self.run
        if run is None:
            return
        finished = run.finished  # before the status, so that the last status shown is the final one
        self.auto_status.configure(text=run.status()[:160], text_color=_text_color())
        self.progress.set(run.fraction())
        if not finished:
            self.after(POLL_MS, self._poll)
            return
        self.auto_button.configure(text="Auto-caption")
        if run.returncode != 0:
            self.auto_status.configure(text_color=ERROR_COLOR)
        self.reload()

    def auto_text(self) -> str:
        return self.auto_status.cget("text")

    def close(self) -> None:
        if not self._kept_typing():
            return
        if self.run is not None and not self.run.finished:
            self.run.stop()
        self.destroy()


class CaptionsRow(ctk.CTkFrame):
    """Under the Data tab's concept rows: which concept's captions to open, and the button that opens them
    (a button in every row would make the row wider than the default window)."""

    def __init__(self, master, binder, gpu_count: Callable[[], int] = lambda: 0, python: str = sys.executable):
        super().__init__(master, fg_color="transparent")
        self.binder, self.gpu_count, self.python = binder, gpu_count, python
        ctk.CTkLabel(self, text="Captions of").pack(side="left", padx=(4, 6))
        self.menu = ctk.CTkOptionMenu(self, values=["-"], width=260, dynamic_resizing=False)
        self.menu.pack(side="left")
        self.open_button = ctk.CTkButton(self, text="Edit captions...", width=120, command=self.open)
        self.open_button.pack(side="left", padx=6)
        Tooltip(self.open_button, "Browse the concept's images with their captions, edit one or many (trigger "
                                  "words, tags, find and replace), and write captions from a local model.")
        self.editor: CaptionEditor | None = None
        """The editor opened last (tests use it)."""
        binder.on_change.append(lambda _path: self.refresh())
        self.refresh()

    def choices(self) -> list[str]:
        return [f"{i + 1}: {c.name or c.path or '(no folder)'}" for i, c in enumerate(self.binder.model.cfg.data.concepts)]

    def refresh(self) -> None:
        choices = self.choices()
        current = self.menu.get()
        self.menu.configure(values=choices or ["-"], state="normal" if choices else "disabled")
        self.open_button.configure(state="normal" if choices else "disabled")
        if current not in choices:
            self.menu.set(choices[0] if choices else "-")

    def open(self, index: int | None = None) -> "CaptionEditor | None":
        """The editor of concept `index` (default: the one chosen), as the config reads it now, saved or not."""
        concepts = self.binder.model.cfg.data.concepts
        if index is None:
            choices = self.choices()
            index = choices.index(self.menu.get()) if self.menu.get() in choices else 0
        if not concepts:
            return None
        source = CaptionSource.of_concept(concepts[index], self.binder.model.cfg.data.tag_separator)
        self.editor = CaptionEditor(self.winfo_toplevel(), source, self.binder.dialogs, self.gpu_count, self.python)
        return self.editor
