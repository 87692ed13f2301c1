"""The Tools tab's controller, Tk-free: the three LoRA tools' fields, the command each runs
(`scripts/lora_tools.py`, in its own process so that the window never waits and never imports torch), and
what the tool reports back (`modules/util/tool_lines.py`): progress, the result line or the error line.

The view (`ui/views/lora_tools_view.py`) lays out `FIELDS`, calls `start` and polls `poll` with after().
"""
from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from modules.util.run_protocol import EVENTS_VARIABLE
from modules.util.tool_lines import parse_tool_line

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "lora_tools.py"


@dataclass(frozen=True)
class ToolField:
    key: str
    """The script's option, without `--`."""
    label: str
    kind: str
    """`model` (a folder, a file or builtin:demo), `lora` (a .safetensors file), `out` (a file or folder to
    write), `lora_out` (a .safetensors file to write), `number`, `choice`, `check`."""
    default: str = ""
    choices: tuple[str, ...] = ()
    required: bool = True
    tip: str = ""


_DEVICE = ToolField("device", "Device", "choice", "auto", ("auto", "cpu", "cuda"), False,
                    "Where the layers are computed, one at a time (auto: a GPU when there is one)")
_OVERWRITE = ToolField("overwrite", "Replace output", "check", "0", required=False,
                       tip="Replace the output if it exists (otherwise an existing output is refused)")
DTYPES = ("fp16", "bf16", "fp32")

TOOLS: dict[str, tuple[str, tuple[ToolField, ...]]] = {
    "merge": ("Merge a LoRA into its base model and write the merged model", (
        ToolField("base-model", "Base model", "model", "builtin:demo",
                  tip="The model the LoRA was trained on: a diffusers folder, a single file or builtin:demo"),
        ToolField("lora", "LoRA", "lora", tip="The LoRA file (kohya/ComfyUI or diffusers layout)"),
        ToolField("out", "Merged model", "out",
                  tip="A folder (diffusers layout) or a name ending in .safetensors (one checkpoint file)"),
        ToolField("strength", "Strength", "number", "1.0", tip="How much of the LoRA to merge (1: all of it)"),
        ToolField("dtype", "Weights", "choice", "fp16", DTYPES, tip="The merged model's precision"),
        _DEVICE, _OVERWRITE)),
    "resize": ("Lower a LoRA's rank, keeping the most of it (SVD); no base model needed", (
        ToolField("lora", "LoRA", "lora", tip="The LoRA file to resize"),
        ToolField("out", "Resized LoRA", "lora_out", tip="The new LoRA (.safetensors)"),
        ToolField("rank", "New rank", "number", "8", required=False,
                  tip="The new rank; with an energy share, the most any module gets"),
        ToolField("energy", "Energy to keep", "number", "", required=False,
                  tip="Instead of one rank: keep this share (0-1] of each module (kohya's sv_fro), e.g. 0.9"),
        _DEVICE, _OVERWRITE)),
    "extract": ("Extract a LoRA from a fine-tuned model and the base it was tuned from", (
        ToolField("base-model", "Base model", "model", "builtin:demo", tip="The model the fine-tune started from"),
        ToolField("tuned-model", "Fine-tuned model", "model", tip="The fine-tuned model (folder or single file)"),
        ToolField("out", "LoRA", "lora_out", tip="The extracted LoRA (.safetensors)"),
        ToolField("rank", "Rank", "number", "32", tip="The LoRA's rank"),
        ToolField("alpha", "Alpha", "number", "", required=False, tip="The LoRA's alpha (empty: the rank)"),
        ToolField("format", "Layout", "choice", "kohya", ("kohya", "peft"),
                  tip="kohya: ComfyUI, A1111, Forge, sd-scripts; peft: diffusers' load_lora_weights"),
        ToolField("dtype", "Weights", "choice", "fp16", DTYPES, tip="The LoRA's precision"),
        ToolField("load-dtype", "Hold models as", "choice", "fp32", DTYPES,
                  tip="The precision both models wait in while the LoRA is extracted: bf16 needs half the memory "
                      "of fp32 (a 12B Flux pair: about 48 GB instead of 96 GB)"),
        ToolField("conv", "Convolutions too", "check", "0", required=False,
                  tip="Also extract the convolutions (LoCon), not only the Linear layers"),
        _DEVICE, _OVERWRITE)),
}


@dataclass
class ToolState:
    running: bool = False
    tool: str = ""
    done: int = 0
    total: int = 0
    what: str = ""
    result: str = ""
    """The finished tool's line (what it wrote)."""
    error: str = ""
    """Why it failed, in one line."""

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    def line(self) -> str:
        if self.running:
            return f"{self.what or 'starting'}... {self.done}/{self.total}" if self.total else "starting..."
        return self.error or self.result


class LoraToolsController:
    def __init__(self, python: str = sys.executable, script: Path = SCRIPT, env: dict | None = None):
        self.python, self.script, self.env = python, script, env
        self.state = ToolState()
        self._process: subprocess.Popen | None = None
        self._queue: queue.Queue = queue.Queue()
        self._tail: collections.deque[str] = collections.deque(maxlen=20)

    def command(self, tool: str, values: dict[str, str]) -> list[str]:
        """The script's command line for `values` (field key -> text); a ValueError of one line names the
        field to fill in or correct."""
        if tool not in TOOLS:
            raise ValueError(f"no tool {tool!r}; the tools are {', '.join(TOOLS)}")
        command = [self.python, str(self.script), tool]
        for spec in TOOLS[tool][1]:
            text = str(values.get(spec.key, spec.default)).strip()
            if spec.kind == "check":
                if text in ("1", "True", "true"):
                    command.append(f"--{spec.key}")
                continue
            if not text or (spec.kind == "choice" and text == "auto"):
                if spec.required:
                    raise ValueError(f"{spec.label}: fill it in ({spec.tip.lower() or 'it is needed'})")
                continue
            if spec.kind == "number":
                try:
                    float(text)
                except ValueError:
                    raise ValueError(f"{spec.label}: {text!r} is not a number") from None
            command += [f"--{spec.key}", text]
        if tool == "resize" and "--rank" not in command and "--energy" not in command:
            raise ValueError("New rank: give the new rank or the energy to keep")
        return command

    def start(self, tool: str, values: dict[str, str]) -> str:
        """Start `tool`; returns "" or, when it cannot start, the line that says why."""
        if self.state.running:
            return "a tool is still running; wait for it or stop it"
        try:
            command = self.command(tool, values)
        except ValueError as error:
            self.state = ToolState(tool=tool, error=str(error))
            return str(error)
        env = dict(self.env if self.env is not None else os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env[EVENTS_VARIABLE] = "1"
        kwargs = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if os.name == "nt" else {"start_new_session": True}
        self.state = ToolState(running=True, tool=tool)
        self._tail.clear()
        self._queue = queue.Queue()
        self._process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                         encoding="utf-8", errors="replace", bufsize=1, **kwargs)
        threading.Thread(target=self._read, args=(self._process, self._queue), daemon=True,
                         name="tandem-lora-tool-reader").start()
        return ""

    @staticmethod
    def _read(process: subprocess.Popen, out: queue.Queue) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            out.put(line.rstrip("\n"))
        out.put(process.wait())

    def poll(self) -> ToolState:
        """Apply what the tool printed since the last call; the state after it."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return self.state
            if isinstance(item, int):
                self._finished(item)
                continue
            message = parse_tool_line(item)
            if message is None:
                if item.strip():
                    self._tail.append(item.strip())
            elif message["type"] == "progress":
                self.state.done, self.state.total, self.state.what = message["done"], message["total"], message["what"]
            else:
                setattr(self.state, message["type"], self._in_tab_words(message["text"]))

    def _in_tab_words(self, text: str) -> str:
        """The script's options named as the tab labels them ("--overwrite" -> 'Replace output')."""
        for spec in sorted(TOOLS.get(self.state.tool, ("", ()))[1], key=lambda s: -len(s.key)):
            text = text.replace(f"--{spec.key}", f"'{spec.label}'")
        return text

    def _finished(self, code: int) -> None:
        self.state.running = False
        self._process = None
        if code != 0 and not self.state.error:
            last = self._tail[-1] if self._tail else f"exit status {code}"
            self.state.error = ("stopped" if code in (-signal.SIGTERM, -signal.SIGKILL) else
                                f"the tool failed: {last}")
        if code == 0 and not self.state.result:
            self.state.result = self._tail[-1] if self._tail else "done"

    def stop(self) -> None:
        """End the running tool (its output is written whole or not at all, so nothing half-written stays)."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        if os.name == "nt":
            process.terminate()
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
