"""The caption editor's logic (modules/data/caption_edit.py): reading as training reads, tags, bulk edits
planned then applied atomically with an undo, and files that are never lost."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from modules.config.train_config import ConceptConfig
from modules.data import caption_edit as ce
from modules.data.concepts import scan_concept


def make_folder(folder: Path, captions: dict[str, str | None]) -> Path:
    """One small image per name; its .txt caption when the value is not None."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, caption in captions.items():
        Image.new("RGB", (16, 16), (len(name) * 20 % 255, 40, 90)).save(folder / f"{name}.png")
        if caption is not None:
            (folder / f"{name}.txt").write_text(caption, encoding="utf-8")
    return folder


@pytest.fixture
def folder(tmp_path):
    return make_folder(tmp_path / "imgs", {"a": "sks, red hair, smiling", "b": "red hair, hat",
                                           "c_no_caption": None, "d": "blue sky"})


def test_reads_captions_as_training_does(folder):
    (folder / "d.txt").write_bytes("caf\xe9, blue sky\n".encode("cp1252"))  # not UTF-8: the fallback
    entries = ce.read_folder(folder)
    scanned = scan_concept(ConceptConfig(path=str(folder)))
    assert [e.image for e in entries] == [r.path for r in scanned]
    assert [e.text for e in entries] == [r.caption for r in scanned]
    assert [e.image.name for e in ce.missing(entries)] == ["c_no_caption.png"]
    assert entries[2].text == "c no caption"  # the file name, as training uses it


def test_tag_counts_and_splitting(folder):
    entries = ce.read_folder(folder)
    assert ce.split_tags(" a,, b ,c ") == ["a", "b", "c"]
    assert ce.split_tags("a | b", "|") == ["a", "b"]
    assert ce.tag_counts(entries) == [("red hair", 2), ("blue sky", 1), ("hat", 1), ("sks", 1), ("smiling", 1)]


def test_bulk_add_plans_then_writes_only_changed_files(folder):
    entries = ce.read_folder(folder)
    edit = ce.plan_add(entries, "sks")
    assert sorted(c.caption_file.name for c in edit.changes) == ["b.txt", "d.txt"]  # a has it, c has no file
    assert edit.summary() == "Add 'sks' first: 2 caption files change."
    assert (folder / "b.txt").read_text() == "red hair, hat"  # nothing written by planning
    done = ce.apply_edit(edit)
    assert done.summary() == "Wrote 2 caption files."
    assert (folder / "b.txt").read_text() == "sks, red hair, hat"
    assert (folder / "d.txt").read_text() == "sks, blue sky"
    assert not (folder / "c_no_caption.txt").exists()
    last = ce.plan_add(ce.read_folder(folder), "smiling", at_start=False)
    assert [c.new for c in last.changes] == ["sks, red hair, hat, smiling", "sks, blue sky, smiling"]


def test_bulk_remove_and_replace(folder):
    entries = ce.read_folder(folder)
    edit = ce.plan_remove(entries, "red hair")
    assert {c.caption_file.name: c.new for c in edit.changes} == {"a.txt": "sks, smiling", "b.txt": "hat"}
    ce.apply_edit(edit)
    entries = ce.read_folder(folder)
    text = ce.plan_replace(entries, "sky", "sea")
    assert [(c.caption_file.name, c.new) for c in text.changes] == [("d.txt", "blue sea")]
    whole = ce.plan_replace(entries, "sky", "sea", whole_tags=True)
    assert whole.changes == []  # "sky" is no whole tag
    whole = ce.plan_replace(entries, "hat", "cap", whole_tags=True)
    assert [(c.caption_file.name, c.new) for c in whole.changes] == [("b.txt", "cap")]
    with pytest.raises(ce.CaptionEditError, match="Type the tag"):
        ce.plan_add(entries, " , ")


def test_undo_restores_exactly_and_spares_later_edits(folder):
    before = {p.name: p.read_bytes() for p in folder.glob("*.txt")}
    done = ce.apply_edit(ce.plan_add(ce.read_folder(folder), "sks"))
    (folder / "d.txt").write_text("edited by hand since")  # the undo must not throw this away
    undone = ce.apply_edit(done.undo)
    assert (folder / "b.txt").read_bytes() == before["b.txt"]
    assert (folder / "d.txt").read_text() == "edited by hand since"
    assert len(undone.written) == 1 and "changed on disk" in undone.failed[0] and "d.txt" in undone.failed[0]


def test_stale_file_is_not_overwritten(folder):
    entries = ce.read_folder(folder)
    edit = ce.plan_add(entries, "sks")
    (folder / "b.txt").write_text("rewritten meanwhile")
    done = ce.apply_edit(edit)
    assert (folder / "b.txt").read_text() == "rewritten meanwhile"
    assert [p.name for p in done.written] == ["d.txt"]
    with pytest.raises(ce.StaleCaption, match="b.txt changed on disk"):
        ce.write_caption(entries[1].caption_file, entries[1].image, "x", entries[1].on_disk)


def test_single_edit_is_atomic_and_creates_a_missing_caption(folder, monkeypatch):
    entry = ce.read_entry(folder / "c_no_caption.png")
    ce.write_caption(entry.caption_file, entry.image, "a new caption", entry.on_disk)
    assert (folder / "c_no_caption.txt").read_text() == "a new caption"
    # A write that fails half-way leaves the old file whole and no temporary file behind.
    import modules.util.atomic as atomic
    real = atomic.os.replace

    def crash(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(atomic.os, "replace", crash)
    entry = ce.read_entry(folder / "a.png")
    with pytest.raises(OSError, match="disk full"):
        ce.write_caption(entry.caption_file, entry.image, "lost?", entry.on_disk)
    monkeypatch.setattr(atomic.os, "replace", real)
    assert (folder / "a.txt").read_text() == "sks, red hair, smiling"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


def test_a_linked_caption_is_refused_and_its_target_kept(folder, tmp_path):
    shared = tmp_path / "shared.txt"
    shared.write_text("red hair, shared")
    (folder / "b.txt").unlink()
    os.symlink(shared, folder / "b.txt")
    entries = ce.read_folder(folder)
    assert entries[1].text == "red hair, shared" and entries[1].is_link
    edit = ce.plan_add(entries, "sks")
    assert "b.txt is a symbolic link" in edit.summary()
    ce.apply_edit(edit)
    assert shared.read_text() == "red hair, shared" and (folder / "b.txt").is_symlink()
    with pytest.raises(ce.CaptionLinkError, match="b.txt is a symbolic link .*Replace the link with a copy"):
        ce.write_caption(entries[1].caption_file, entries[1].image, "x", entries[1].on_disk)


def test_other_caption_extension_and_none(tmp_path):
    folder = make_folder(tmp_path / "f", {"x": None})
    (folder / "x.caption").write_text("from caption file")
    assert ce.read_folder(folder, "caption")[0].text == "from caption file"
    entry = ce.read_folder(folder, "")[0]
    assert entry.text == "x" and entry.caption_file is None
    with pytest.raises(ce.CaptionEditError, match="reads no caption files .*Set the concept's Captions to .txt"):
        ce.write_caption(entry.caption_file, entry.image, "y", None)
    with pytest.raises(ce.CaptionEditError, match="is not a folder"):
        ce.read_folder(tmp_path / "nope")
