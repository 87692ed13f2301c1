"""The Run tab's sample gallery: pick a run of this workspace, step through its samplings, see every prompt.

While a run renders samples the gallery follows it (the newest sampling), unless the user has gone back
to an earlier sampling or another run; a new run never replaces what an earlier one wrote (each run's
samples have their own folder, ui/sample_gallery.py reads them). A video family's samples (animated WebPs)
play in their cells, looping, while their sampling is shown.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import customtkinter as ctk
from PIL import Image, ImageOps

from modules.util.animation import read_frames

from ..sample_gallery import SAMPLE_FILE, Sample, Sampling, run_folder, run_of_sample, run_prompts, sample_runs, \
    samplings
from .buttons import Button, OptionMenu
from .frame_player import FramePlayer
from .tooltip import Tooltip

THUMB_PX = 180
PER_ROW = 5
NO_SAMPLE = "No sample yet"


class SampleGallery(ctk.CTkFrame):
    def __init__(self, master, folders: Callable[[], tuple[Path, Path]]):
        """`folders()`: the workspace's samples folder and the workspace (as the training process sees them)."""
        super().__init__(master, fg_color=("gray90", "gray17"))
        self.folders = folders
        self.run: str | None = None
        self.index: int | None = None
        """The sampling shown (an index into `self.samplings`), None: none."""
        self.samplings: list[Sampling] = []
        self.live_run: str | None = None
        """The run that renders samples now (named by its first sample's folder)."""
        self.following = True
        """Show each new sampling of the live run as it comes (False once the user went elsewhere)."""
        self._live: dict[str, dict[Path, Sample]] = {}
        """Samples the live runs announced, by run: shown even before (or without) a look at the folder."""
        self._images: list[ctk.CTkImage] = []
        self.players: list[FramePlayer] = []
        """The video samples playing now (tests read them)."""

        head = ctk.CTkFrame(self, fg_color="transparent")
        head.grid(row=0, column=0, sticky="w", padx=8, pady=(6, 2))
        ctk.CTkLabel(head, text="Samples", font=ctk.CTkFont(weight="bold")).grid(row=0, column=0, padx=(0, 8))
        self.run_menu = OptionMenu(head, values=[""], width=230, dynamic_resizing=False,
                                          command=self.choose_run)
        self.run_menu.grid(row=0, column=1, padx=(0, 8))
        Tooltip(self.run_menu, "The runs of this workspace that rendered samples, newest first. Each run keeps its "
                               "own samples (samples/<run> in the workspace folder).")
        self.previous = Button(head, text="◀", width=32, command=lambda: self.step_to(-1))
        self.previous.grid(row=0, column=2)
        self.position = ctk.CTkLabel(head, text="", width=190)
        self.position.grid(row=0, column=3, padx=4)
        self.next = Button(head, text="▶", width=32, command=lambda: self.step_to(+1))
        self.next.grid(row=0, column=4)
        self.newest = Button(head, text="Newest", width=70, fg_color="gray40", command=self.show_newest)
        self.newest.grid(row=0, column=5, padx=(8, 0))
        Tooltip(self.previous, "The sampling before this one (every prompt at an earlier step).")
        Tooltip(self.next, "The sampling after this one.")
        Tooltip(self.newest, "The newest sampling of the newest run, and follow new ones as they come.")
        self.body = ctk.CTkFrame(self, fg_color="transparent")
        self.body.grid(row=1, column=0, sticky="w", padx=8, pady=(2, 8))
        self.empty = ctk.CTkLabel(self.body, text=NO_SAMPLE, width=THUMB_PX, height=THUMB_PX // 2,
                                  fg_color=("gray85", "gray20"), corner_radius=6)
        self.cells: list[tuple[ctk.CTkLabel, ctk.CTkLabel]] = []
        self.refresh()

    # --- what to show -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the workspace again (another config, a run ended): keep the run shown if it is still there."""
        runs = self._runs()
        self.run_menu.configure(values=runs or [NO_SAMPLE], state="normal" if runs else "disabled")
        if self.run not in runs:
            self.run = runs[0] if runs else None
            self.index = None
        self._load(keep_step=True)

    def other_workspace(self) -> None:
        """Another workspace: the samples the runs of the previous one announced are not its (they showed on)."""
        self._live.clear()
        self.live_run, self.following = None, True
        self.run, self.index = None, None
        self.refresh()

    def new_run(self) -> None:
        """A run starts: show its samples as they come (none yet)."""
        self.live_run, self.following = None, True
        self.run, self.index, self.samplings = None, None, []
        self.run_menu.set(NO_SAMPLE)
        self._show()

    def add_live(self, event: dict) -> None:
        """A sample the running training announced (its `sample` event)."""
        samples_dir, _ = self.folders()
        path = Path(str(event.get("path", "")))
        match = SAMPLE_FILE.match(path.name)
        index = int(match.group(2)) if match else len(self._live.get(run_of_sample(path, samples_dir), {}))
        run = run_of_sample(path, samples_dir)
        self._live.setdefault(run, {})[path] = Sample(path, int(event.get("step", 0) or 0), index,
                                                      str(event.get("prompt", "")))
        self.live_run = run
        if self.following:
            self.run = run
            self.index = None  # the newest
        self.run_menu.configure(values=self._runs(), state="normal")
        self._load(keep_step=not self.following)

    def choose_run(self, run: str) -> None:
        """The run menu: show that run's newest sampling."""
        self.run, self.index = run, None
        self.following = run == self.live_run
        self._load()

    def step_to(self, delta: int) -> None:
        if self.index is None or not self.samplings:
            return
        self.index = max(0, min(len(self.samplings) - 1, self.index + delta))
        self.following = self.run == self.live_run and self.index == len(self.samplings) - 1
        self._show()

    def show_newest(self) -> None:
        runs = self._runs()
        self.run, self.index = (runs[0] if runs else None), None
        self.following = True
        self._load()

    def showing(self) -> tuple[str | None, int | None, list[str]]:
        """(run, step, the prompts shown) - tests read it."""
        if self.index is None or not self.samplings:
            return self.run, None, []
        sampling = self.samplings[self.index]
        return self.run, sampling.step, [s.prompt for s in sampling.samples]

    # --- drawing ------------------------------------------------------------------------------
    def _runs(self) -> list[str]:
        samples_dir, _ = self.folders()
        on_disk = sample_runs(samples_dir)
        live = [run for run in self._live if run not in on_disk]
        return sorted(live, reverse=True) + on_disk

    def _load(self, keep_step: bool = False) -> None:
        """Read the shown run's samplings (its folder and what it announced) and show one."""
        step = self.samplings[self.index].step if keep_step and self.index is not None and self.samplings else None
        if self.run is None:
            self.samplings = []
        else:
            samples_dir, workspace = self.folders()
            prompts = run_prompts(workspace, self.run)
            found = {s.path: s for sampling in samplings(run_folder(samples_dir, self.run), prompts)
                     for s in sampling.samples}
            for path, sample in self._live.get(self.run, {}).items():
                found[path] = sample  # the announced prompt text is the one the run used
            by_step: dict[int, list[Sample]] = {}
            for sample in found.values():
                by_step.setdefault(sample.step, []).append(sample)
            self.samplings = [Sampling(s, tuple(sorted(by_step[s], key=lambda x: x.prompt_index)))
                              for s in sorted(by_step)]
        steps = [s.step for s in self.samplings]
        self.index = (steps.index(step) if step in steps else len(steps) - 1) if steps else None
        self._show()

    def destroy(self) -> None:
        self._stop_players()  # their next frame would go to a label that is gone
        super().destroy()

    def _stop_players(self) -> None:
        for player in self.players:
            player.stop()
        self.players = []

    def _show(self) -> None:
        self._stop_players()
        if self.run is not None:
            self.run_menu.set(self.run)
        sampling = self.samplings[self.index] if self.index is not None and self.samplings else None
        count = len(self.samplings)
        self.position.configure(text=f"step {sampling.step} · sampling {self.index + 1} of {count}"
                                if sampling else "")
        self.previous.configure(state="normal" if sampling and self.index > 0 else "disabled")
        self.next.configure(state="normal" if sampling and self.index < count - 1 else "disabled")
        shown = list(sampling.samples) if sampling else []
        while len(self.cells) < len(shown):
            image = ctk.CTkLabel(self.body, text="", width=THUMB_PX, height=THUMB_PX, fg_color=("gray85", "gray20"),
                                 corner_radius=6)
            caption = ctk.CTkLabel(self.body, text="", wraplength=THUMB_PX, justify="left", anchor="w")
            self.cells.append((image, caption))
        images = []
        for i, (image_label, caption) in enumerate(self.cells):
            if i >= len(shown):
                # image="" takes the picture off a Tk label; image=None would leave it on a deleted image
                # (customtkinter#2494), and the next configure of the label then fails.
                image_label.configure(image="", text="")
                image_label.grid_remove()
                caption.grid_remove()
                continue
            sample = shown[i]
            frames = _thumbnails(sample.path)
            if frames is None:
                image_label.configure(image="", text=f"{sample.path.name}\ncould not be read")
            else:
                thumbs = [(ctk.CTkImage(light_image=picture, dark_image=picture, size=picture.size), ms)
                          for picture, ms in frames]
                images += [thumb for thumb, _ in thumbs]
                if len(thumbs) == 1:
                    image_label.configure(image=thumbs[0][0], text="")
                else:
                    player = FramePlayer(image_label, thumbs)
                    player.start()
                    self.players.append(player)
            caption.configure(text=sample.prompt)
            row, col = divmod(i, PER_ROW)
            image_label.grid(row=2 * row, column=col, padx=(0, 10), pady=(4, 0))
            caption.grid(row=2 * row + 1, column=col, sticky="nw", padx=(0, 10))
        self._images = images  # the previous thumbnails go only now that no label holds them
        if shown:
            self.empty.grid_remove()
        else:
            self.empty.grid(row=0, column=0)


def _thumbnails(path: Path) -> list[tuple[Image.Image, int]] | None:
    """Each frame of the sample (one for an image) fitted into THUMB_PX both ways, small samples (the demo's
    64 px) enlarged, large ones shrunk, with how long it shows in ms; None where the file cannot be read."""
    try:
        frames = read_frames(path)
    except OSError:
        return None
    size = (THUMB_PX, THUMB_PX)
    resample = Image.Resampling.NEAREST if max(frames[0][0].size) < THUMB_PX else Image.Resampling.LANCZOS
    return [(ImageOps.contain(picture, size, resample), ms) for picture, ms in frames]
