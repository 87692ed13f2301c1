"""The caption editor's state, without Tk: a concept's images a page at a time, filters, one caption's edit,
bulk edits planned (how many files change) before they are applied, the undo of the last one, tag counts,
and auto-captioning as a `scripts/caption.py` subprocess whose lines become progress.

The caption rules themselves are `modules/data/caption_edit.py`. It lives below `modules.data`, whose package
imports PyTorch, so it is imported when a folder is first read (`CaptionEditorState.load`, off the Tk thread),
never when the GUI starts.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE_SIZE = 12
THUMB_PX = 112


@dataclass(frozen=True)
class CaptionSource:
    """Where the captions are and how training reads them: a concept's folder, caption extension and
    sub-folder option, and the config's tag separator."""

    folder: str
    extension: str = ".txt"
    recursive: bool = False
    separator: str = ","
    name: str = ""

    @classmethod
    def of_concept(cls, concept, separator: str) -> "CaptionSource":
        return cls(concept.path, concept.caption_extension, concept.recursive, separator,
                   concept.name or Path(concept.path).name)


def thumbnail(path: Path, size: int = THUMB_PX):
    """A PIL thumbnail of an image at most `size` px wide and high; None for a clip or an unreadable file."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.draft("RGB", (size, size))  # a JPEG decodes at a fraction of its size
            picture = image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    picture.thumbnail((size, size))
    return picture


class CaptionEditorState:
    def __init__(self, source: CaptionSource, page_size: int = PAGE_SIZE):
        self.source = source
        self.page_size = page_size
        self.entries: list = []
        self.loaded = False
        self.filter_text = ""
        self.only_missing = False
        self.page = 0
        self.pending = None
        """The planned bulk edit (`caption_edit.BulkEdit`) waiting for Apply."""
        self.last_edit = None
        """What undoes the last applied bulk edit (None: nothing to undo)."""

    # --- reading ------------------------------------------------------------------------------
    def load(self) -> None:
        """Read the folder (seconds for a large one, and PyTorch's import the first time: call it off the Tk
        thread). Raises `caption_edit.CaptionEditError` naming the folder."""
        from modules.data import caption_edit as ce
        from modules.data.builtin_datasets import resolve_concept_path

        try:
            folder = resolve_concept_path(self.source.folder)
        except ValueError as error:
            raise ce.CaptionEditError(str(error)) from error
        self.entries = ce.read_folder(folder, ce.caption_extension(self.source.extension), self.source.recursive)
        self.loaded = True
        self.page = min(self.page, self.pages() - 1)

    def _reread(self, paths) -> None:
        from modules.data import caption_edit as ce

        wanted = {Path(p) for p in paths}
        self.entries = [ce.read_entry(e.image, ce.caption_extension(self.source.extension))
                        if e.caption_file in wanted else e for e in self.entries]

    # --- what is shown ------------------------------------------------------------------------
    def shown(self) -> list[int]:
        """Indexes into `entries` of the images the filters let through."""
        needle = self.filter_text.strip().lower()
        return [i for i, e in enumerate(self.entries)
                if (not self.only_missing or not e.has_caption) and (not needle or needle in e.text.lower()
                                                                     or needle in e.image.name.lower())]

    def set_filter(self, text: str | None = None, only_missing: bool | None = None) -> None:
        if text is not None:
            self.filter_text = text
        if only_missing is not None:
            self.only_missing = only_missing
        self.page = 0
        self.pending = None  # a plan was made for the images shown before

    def pages(self) -> int:
        return max(1, -(-len(self.shown()) // self.page_size))

    def turn(self, by: int) -> None:
        self.page = max(0, min(self.pages() - 1, self.page + by))

    def page_indexes(self) -> list[int]:
        start = self.page * self.page_size
        return self.shown()[start:start + self.page_size]

    def summary(self) -> str:
        total = len(self.entries)
        without = sum(1 for e in self.entries if not e.has_caption)
        ext = self.source.extension.strip()
        where = f"captions from {ext if ext.startswith('.') else '.' + ext} files" if ext else \
            "no caption files (file names are the captions)"
        shown = len(self.shown())
        filtered = f" · {shown} shown" if shown != total else ""
        return f"{total} image{'' if total == 1 else 's'} · {without} without a caption · {where}{filtered}"

    def tag_counts(self, limit: int = 200) -> list[tuple[str, int]]:
        from modules.data.caption_edit import tag_counts

        return tag_counts((self.entries[i] for i in self.shown()), self.source.separator)[:limit]

    def missing_names(self) -> list[str]:
        return [e.image.name for e in self.entries if not e.has_caption]

    # --- one caption --------------------------------------------------------------------------
    def save(self, index: int, text: str) -> tuple[bool, str]:
        """Write entry `index`'s caption (atomically; refused for a link or a file changed on disk, with
        the line why). Returns (written or unchanged, the line to show)."""
        from modules.data import caption_edit as ce

        entry = self.entries[index]
        text = text.strip()
        if entry.has_caption and text == entry.text:
            return True, f"{entry.image.name}: unchanged."
        try:
            ce.write_caption(entry.caption_file, entry.image, text, entry.on_disk)
        except (ce.CaptionEditError, OSError) as error:
            return False, str(error)
        self._reread([entry.caption_file])
        self.pending = None
        return True, f"Saved {entry.caption_file.name}."

    # --- bulk edits ---------------------------------------------------------------------------
    def plan(self, action: str, text: str, replacement: str = "", whole_tags: bool = False) -> str:
        """Plan `action` (`add_first`, `add_last`, `remove`, `replace`) over the shown images; nothing is
        written until `apply`. Returns the line saying how many caption files would change."""
        from modules.data import caption_edit as ce

        entries = [self.entries[i] for i in self.shown()]
        sep = self.source.separator
        try:
            if action in ("add_first", "add_last"):
                edit = ce.plan_add(entries, text, sep, at_start=action == "add_first")
            elif action == "remove":
                edit = ce.plan_remove(entries, text, sep)
            elif action == "replace":
                edit = ce.plan_replace(entries, text, replacement, sep, whole_tags)
            else:
                raise ValueError(f"unknown bulk action {action!r}")
        except ce.CaptionEditError as error:
            self.pending = None
            return str(error)
        if len(entries) != len(self.entries):
            edit.description += f" (in the {len(entries)} images shown)"
        self.pending = edit if edit.changes else None
        return edit.summary() + ("" if edit.changes else " Nothing to write.")

    def apply(self) -> str:
        """Write the planned edit; it becomes the one Undo reverts."""
        from modules.data.caption_edit import apply_edit

        if self.pending is None:
            return "Nothing planned: choose an edit first."
        done = apply_edit(self.pending)
        self.pending = None
        self.last_edit = done.undo if done.written else self.last_edit
        self._reread(done.written)
        return done.summary() + (" Undo reverts it." if done.written else "")

    def undo(self) -> str:
        from modules.data.caption_edit import apply_edit

        if self.last_edit is None:
            return "No bulk edit to undo."
        done = apply_edit(self.last_edit)
        self.last_edit = None
        self.pending = None
        self._reread(done.written)
        return "Undone: " + done.summary()


PROGRESS = re.compile(r"^\[(\d+)/(\d+)\] ")
TOTAL = re.compile(r"^(\d+) image\(s\) to caption")


class AutoCaptionRun:
    """`scripts/caption.py` for one folder as a subprocess; its lines are read on a thread and become
    `done` / `total` / `last_line`; `finished` once it has exited (`returncode`, `error`: its last error line)."""

    def __init__(self, source: CaptionSource, model: str, prefix: str = "", overwrite: bool = False,
                 processes: int = 1, python: str = sys.executable):
        self.source, self.model, self.prefix, self.overwrite = source, model, prefix, overwrite
        self.processes, self.python = max(1, processes), python
        self.done = 0
        self.total: int | None = None
        self.last_line = ""
        self.error = ""
        self.returncode: int | None = None
        self.process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def command(self) -> list[str]:
        command = [self.python, str(REPO / "scripts" / "caption.py"), "--model", self.model,
                   "--folder", self.source.folder, "--caption-extension", self.source.extension or ".txt",
                   "--separator", self.source.separator, "--num-gpus", str(self.processes)]
        if self.prefix.strip():
            command += ["--prefix", self.prefix.strip()]
        if self.overwrite:
            command.append("--overwrite")
        if self.source.recursive:
            command.append("--recursive")
        return command

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        # Its own process group: Stop ends the script and the processes it spawned for the GPUs together.
        self.process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=env, cwd=REPO, start_new_session=os.name == "posix")
        self._readers = [threading.Thread(target=self._read, args=(stream, is_error), daemon=True,
                                          name=f"tandem-caption-{'err' if is_error else 'out'}")
                         for stream, is_error in ((self.process.stdout, False), (self.process.stderr, True))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, is_error: bool) -> None:
        for line in stream:
            line = line.rstrip()
            if not line:
                continue
            with self._lock:
                if is_error:
                    # The script's own line ("caption.py: ...") says what is wrong; library noise does not.
                    if line.startswith("caption.py: ") or not (self.error.startswith("caption.py: ") or line.startswith(
                            ("[transformers]", "Loading", "Writing", "Warning", "  "))):
                        self.error = line
                    continue
                self.last_line = line
                progress, total = PROGRESS.match(line), TOTAL.match(line)
                if progress:
                    self.done, self.total = int(progress.group(1)), int(progress.group(2))
                elif total:
                    self.total = int(total.group(1))

    @property
    def finished(self) -> bool:
        """The process has exited and its last line was read."""
        if self.process is None:
            return False
        if self.returncode is None and self.process.poll() is not None and not any(
                reader.is_alive() for reader in self._readers):
            self.returncode = self.process.returncode
        return self.returncode is not None

    def status(self) -> str:
        """The line the editor shows."""
        finished = self.finished
        with self._lock:
            if finished:
                if self.returncode == 0:
                    return self.last_line or "Captioning finished."
                return self.error or f"Captioning failed (exit code {self.returncode})."
            if self.total is None:
                return "Loading the captioning model..."
            return f"Captioning {self.done} of {self.total}: {self.last_line}" if self.done else \
                f"{self.total} image(s) to caption: loading the model..."

    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            if os.name == "posix":
                os.killpg(self.process.pid, signal.SIGTERM)
            else:
                self.process.terminate()
        except ProcessLookupError:  # it ended meanwhile
            pass
