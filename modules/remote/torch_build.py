"""Which PyTorch build Tandem's own environment on a remote gets, and roughly what it downloads.

The PyTorch setting (`--torch-spec`, the GUI's PyTorch field, `RemoteHost.torch_spec`) reads
`[REQUIREMENT] [[--index-url] URL]`:

    torch==2.13.0                                                 that version from PyPI
    torch>=2.4,<2.15 --index-url https://download.pytorch.org/whl/cu126     a CUDA 12.6 build
    torch==2.13.0 https://download.pytorch.org/whl/cu126          the same, the URL alone (the GUI's words)
    --index-url https://download.pytorch.org/whl/cpu              the default version, CPU build

REQUIREMENT is `torch` with optional version specifiers and no spaces (default `torch>=2.4`, install.sh's);
URL is an http(s) or file URL. Anything else is refused before any connection (`spec_problems`), so no
value of this setting can run anything on either side; the values reach the remote shell quoted.

Empty, on a machine without NVIDIA's driver, the CPU build is chosen: PyPI's Linux torch is the CUDA one, a
~3 GB download (5.7 GB installed, issue 54) of which a GPU-less machine uses nothing; the CPU build is ~200 MB.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

DEFAULT_REQUIREMENT = "torch>=2.4"
"""install.sh's default torch requirement."""
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_OPTION = "--index-url"
SYNTAX = (f"a torch requirement such as torch==2.13.0 (no spaces), optionally followed by {INDEX_OPTION} URL, "
          f"e.g. 'torch==2.13.0 {INDEX_OPTION} {CPU_INDEX}'")
_REQUIREMENT = re.compile(r"torch(?:(?:===|==|!=|<=|>=|~=|<|>)[A-Za-z0-9.*+!_-]+"
                          r"(?:,(?:===|==|!=|<=|>=|~=|<|>)[A-Za-z0-9.*+!_-]+)*)?", re.IGNORECASE)
_URL = re.compile(r"(?:https?|file)://[A-Za-z0-9._~:/?#@%+=,!-]+")
"""No quote, space, `$`, backtick, `;`, `&`, `|`, `<`, `>`, `(`, `)` or backslash: nothing a shell reads."""

# Rough sizes for the message before an install (PyTorch 2.x on Linux x86_64, with Tandem's other packages).
CPU_SIZE = "about 200 MB to download, about 1 GB installed"
CUDA_SIZE = "about 3 GB to download (torch and NVIDIA's CUDA libraries), about 6 GB installed"


def parse_spec(text: str) -> tuple[str, str]:
    """`[REQUIREMENT] [--index-url URL]` -> (requirement or "", URL or ""); ValueError naming what is wrong."""
    words = (text or "").split()
    requirement = index = ""
    while words:
        word = words.pop(0)
        if word == INDEX_OPTION and not words:
            raise ValueError(f"PyTorch setting {text!r}: {INDEX_OPTION} needs a URL; give {SYNTAX}")
        if word == INDEX_OPTION and not index:
            index = words.pop(0)
        elif word.startswith(INDEX_OPTION + "=") and not index:
            index = word[len(INDEX_OPTION) + 1:]
        elif _URL.fullmatch(word) and not index:
            index = word  # a URL alone names the index too: the GUI's field speaks no command-line flags
        elif not word.startswith("-") and not requirement and not index:
            requirement = word
        else:
            raise ValueError(f"PyTorch setting {text!r}: {word!r} is not expected there; give {SYNTAX}")
    if requirement and not _REQUIREMENT.fullmatch(requirement):
        raise ValueError(f"PyTorch setting {text!r}: {requirement!r} is not a torch requirement; give {SYNTAX}")
    if (index or INDEX_OPTION in text) and not _URL.fullmatch(index):
        raise ValueError(f"PyTorch setting {text!r}: {index!r} is not an http(s) or file URL without spaces, "
                         f"quotes or shell characters; give {SYNTAX}")
    return requirement, index


def spec_problems(text: str) -> list[str]:
    try:
        parse_spec(text)
    except ValueError as e:
        return [str(e)]
    return []


@dataclass(frozen=True)
class TorchBuild:
    requirement: str
    index_url: str
    """"" : pip's default index (PyPI)."""
    why: str = ""
    """Why this build when the user did not name it (no NVIDIA driver), or a warning about the one named."""

    @property
    def cpu(self) -> bool:
        return "+cpu" in self.requirement or self.index_url.rstrip("/").endswith("/cpu")

    def pip_arguments(self) -> list[str]:
        """What follows `pip install` for torch, one list item per argument."""
        return [*([INDEX_OPTION, self.index_url] if self.index_url else []), self.requirement]

    def shell_words(self) -> str:
        """pip_arguments as words of an sh command, each quoted."""
        return " ".join(shlex.quote(a) for a in self.pip_arguments())

    def size(self) -> str:
        if self.cpu:
            return CPU_SIZE
        if not self.index_url or "download.pytorch.org" in self.index_url:
            return CUDA_SIZE
        return f"its size depends on that index's build (PyTorch's CUDA build: {CUDA_SIZE})"

    def describe(self) -> str:
        """`PyTorch's CPU build (torch>=2.4 from https://...): about 200 MB to download, ...; no NVIDIA driver`"""
        kind = "CPU build" if self.cpu else ("build from that index" if self.index_url and self.size() != CUDA_SIZE
                                             else "CUDA build")
        where = self.index_url or "PyPI"
        return f"PyTorch's {kind} ({self.requirement} from {where}): {self.size()}" + (f"; {self.why}" if self.why else "")


def choose(spec: str, values: dict[str, str]) -> TorchBuild:
    """The build for the PyTorch setting `spec` on a machine the check saw as `values` (`Report.values`; empty:
    not checked, taken as one with NVIDIA's driver). Raises ValueError for a setting `spec_problems` refuses."""
    requirement, index = parse_spec(spec)
    no_driver = bool(values) and values.get("nvidia_smi") != "yes"
    why = ""
    if not index and no_driver:
        if not spec.strip():
            index, why = CPU_INDEX, "chosen because the machine has no NVIDIA driver (nvidia-smi)"
        else:
            why = (f"the machine has no NVIDIA driver, and PyPI's Linux torch is the CUDA build: add "
                   f"{INDEX_OPTION} {CPU_INDEX} to the PyTorch setting for the CPU build")
    return TorchBuild(requirement or DEFAULT_REQUIREMENT, index, why)
