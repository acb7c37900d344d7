"""The golden store: checksums, model identity, one-line errors, atomic and never-silent writes."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_cdna2.goldens import (
    MANIFEST,
    GoldenError,
    GoldenStore,
    GoldenWriter,
    decode_tokens,
    encode_prompt,
    load_prompts,
    sha256_file,
)

SHA_A, SHA_B = "a" * 64, "b" * 64


def _write(out, regen=False, value=1.0, model_sha=SHA_A, **edit):
    """A complete one-prompt store: prompt [0, 1, 2], one greedy step (token 3), vocabulary 4; the greedy logits
    are the teacher's at the last prompt position. `edit` replaces tensors ("teacher.KEY" / "greedy.KEY") or
    manifest fields."""
    logits = torch.full((3, 4), value)
    files = {"teacher": {"p00.logits": logits, "p00.input_ids": torch.arange(3)},
             "greedy": {"p00.tokens": torch.tensor([3]), "p00.logits": logits[2:].clone()}}
    manifest = {"model_sha256": model_sha, "prompts": [{"name": "p00", "tokens": [0, 1, 2]}], "steps": 1,
                "dtype": "float64", "vocab_size": 4}
    for key, v in edit.items():
        file, _, name = key.partition(".")
        if file in files and name:
            files[file]["p00." + name] = v
        else:
            manifest[key] = v
    with GoldenWriter(out, regen=regen) as w:
        for file, tensors in files.items():
            w.write(f"{file}.safetensors", tensors)
        w.manifest.update(manifest)
    return out


def _siblings(folder):
    return sorted(p.name for p in folder.parent.iterdir())


def test_write_then_open_lazily(tmp_path):
    out = _write(tmp_path / "g")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"] == {f: sha256_file(out / f) for f in ("greedy.safetensors", "teacher.safetensors")}
    store = GoldenStore.open(out, expected_model_sha256=SHA_A)
    assert set(store._cache) == {("teacher.safetensors", "p00.logits"), ("teacher.safetensors", "p00.input_ids"),
                                 ("greedy.safetensors", "p00.logits"), ("greedy.safetensors", "p00.tokens")}
    assert not any(f == "taps.safetensors" for f, _ in store._cache)  # the rest loads lazily
    assert torch.equal(store.teacher_logits("p00"), torch.ones(3, 4))
    assert store.prompt("p00").input_ids().tolist() == [[0, 1, 2]]
    assert _siblings(out) == ["g"]  # no temporary folder left behind
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {0o644}  # readable by the users who share it


def test_flipped_byte_is_refused_naming_file_and_both_hashes(tmp_path):
    out = _write(tmp_path / "g")
    f = out / "teacher.safetensors"
    want = sha256_file(f)
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(GoldenError) as ei:
        GoldenStore.open(out)
    msg = str(ei.value)
    assert "\n" not in msg
    assert str(f) in msg and want in msg and sha256_file(f) in msg


def test_goldens_of_another_model_are_refused_naming_both(tmp_path):
    out = _write(tmp_path / "g")
    with pytest.raises(GoldenError, match=f"model sha256 {SHA_A}, but the model under test has sha256 {SHA_B}"):
        GoldenStore.open(out, expected_model_sha256=SHA_B)


def test_missing_things_name_the_thing_and_the_fix(tmp_path):
    with pytest.raises(GoldenError, match=r"does not exist; rebuild with `cdna2 goldens build"):
        GoldenStore.open(tmp_path / "nope")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(GoldenError, match=r"a_file is a file, not a folder: pass the store's folder"):
        GoldenStore.open(tmp_path / "a_file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GoldenError, match=r"no manifest.json in .*empty: not a golden store"):
        GoldenStore.open(tmp_path / "empty")
    out = _write(tmp_path / "g")
    store = GoldenStore.open(out)
    with pytest.raises(GoldenError, match=r"no tensor 'p09.logits'"):
        store.teacher_logits("p09")
    with pytest.raises(GoldenError, match=r"no file 'taps.safetensors' in manifest.json"):
        store.taps("p00")
    with pytest.raises(GoldenError, match=r"no prompt 'p01' \(have: p00\)"):
        store.prompt("p01")
    (out / "teacher.safetensors").unlink()
    with pytest.raises(GoldenError, match=r"teacher.safetensors listed in manifest.json is missing"):
        GoldenStore.open(out)


def test_bad_manifest(tmp_path):
    out = _write(tmp_path / "g")
    (out / MANIFEST).write_text("{")
    with pytest.raises(GoldenError, match="not valid JSON"):
        GoldenStore.open(out)
    (out / MANIFEST).write_text(json.dumps({"format": 1, "prompts": [], "files": {}}))
    with pytest.raises(GoldenError, match="missing key 'model_sha256'"):
        GoldenStore.open(out)
    (out / MANIFEST).write_text(json.dumps({"format": 99, "model_sha256": None, "prompts": [], "files": {}}))
    with pytest.raises(GoldenError, match="format 99"):
        GoldenStore.open(out)


@pytest.mark.parametrize("edit, message", [
    ({"files": ["teacher.safetensors"]}, "'files' must map each file name to its sha256"),
    ({"files": {}}, "'files' must map each file name to its sha256"),
    ({"prompts": [{"name": "p00"}]}, "'prompts' must be a list of {name, tokens: .token ids.}"),
    ({"prompts": [{"name": "p00", "tokens": []}]}, "'prompts' must be a list"),
    ({"prompts": "p00"}, "'prompts' must be a list"),
    ({"steps": "x"}, "'steps' must be a count or a list of counts"),
])
def test_a_manifest_of_the_wrong_shape_is_one_error(tmp_path, edit, message):
    """A hand-edited or foreign manifest is refused at open, naming the field (not a KeyError in a test)."""
    out = _write(tmp_path / "g")
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, **edit}))
    with pytest.raises(GoldenError, match=f"manifest.json: {message}"):
        GoldenStore.open(out)


def test_a_tensor_file_rewritten_with_its_hash_but_unreadable_is_one_error(tmp_path):
    out = _write(tmp_path / "g")
    f = out / "teacher.safetensors"
    f.write_bytes(f.read_bytes()[:-5])
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"]["teacher.safetensors"] = sha256_file(f)
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(GoldenError, match=r"teacher.safetensors: unreadable safetensors .*restore it, or"):
        GoldenStore.open(out).teacher_logits("p00")


def test_never_overwrites_without_regen(tmp_path):
    out = _write(tmp_path / "g")
    before = (out / "teacher.safetensors").read_bytes()
    with pytest.raises(GoldenError, match=r"goldens already exist at .*refusing to overwrite.*--cdna2-regen-goldens"):
        _write(out, value=2.0)
    assert (out / "teacher.safetensors").read_bytes() == before
    _write(out, regen=True, value=2.0)
    assert torch.equal(GoldenStore.open(out).teacher_logits("p00"), torch.full((3, 4), 2.0))
    assert _siblings(out) == ["g"]


def test_failed_write_leaves_the_old_store_and_no_temp(tmp_path):
    out = _write(tmp_path / "g")
    before = (out / "teacher.safetensors").read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        with GoldenWriter(out, regen=True) as w:
            w.write("teacher.safetensors", {"x": torch.zeros(1)})
            raise RuntimeError("boom")
    assert (out / "teacher.safetensors").read_bytes() == before
    assert _siblings(out) == ["g"]
    with pytest.raises(RuntimeError):
        with GoldenWriter(tmp_path / "new") as w:
            raise RuntimeError("boom")
    assert not (tmp_path / "new").exists()


def test_regen_never_replaces_a_folder_that_is_not_a_store(tmp_path):
    """A model folder (or any folder without a manifest) given as the goldens' destination by mistake: --regen
    would swap the whole folder out, so it is refused and every file stays."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(GoldenError, match=r"model is not empty and has no manifest.json.*pass a new or empty folder"):
        _write(model, regen=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (model / "config.json").read_text() == "{}"


def test_an_empty_folder_may_receive_a_store(tmp_path):
    (tmp_path / "g").mkdir()
    GoldenStore.open(_write(tmp_path / "g"))


def test_prompts_encoding_and_files(tmp_path):
    assert encode_prompt(b"hi").tolist() == [104, 105]
    assert encode_prompt("\u00e9").tolist() == [0xC3, 0xA9]
    with pytest.raises(ValueError, match="vocabulary of >= 256"):
        encode_prompt(b"x", vocab_size=100)
    assert decode_tokens([104, 105, 257, 33]) == "hi<257>!"
    (tmp_path / "p.json").write_text(json.dumps(["a b", "c"]))
    assert load_prompts(tmp_path / "p.json") == [b"a b", b"c"]
    (tmp_path / "p.txt").write_bytes(b"one\n\ntwo\n")
    assert load_prompts(tmp_path / "p.txt") == [b"one", b"two"]
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(GoldenError, match="expected a JSON list of non-empty strings"):
        load_prompts(tmp_path / "bad.json")
    with pytest.raises(GoldenError, match="prompts file .*missing.txt"):
        load_prompts(tmp_path / "missing.txt")


def test_goldens_without_a_model_hash_are_refused_for_a_known_model(tmp_path):
    """A manifest whose model_sha256 is null cannot be tied to the model under test: one line, the fix."""
    _write(tmp_path / "g", model_sha=None)
    assert json.loads((tmp_path / "g" / "manifest.json").read_text())["model_sha256"] is None
    GoldenStore.open(tmp_path / "g")  # nothing to check against: fine
    with pytest.raises(GoldenError, match="model_sha256 is null") as e:
        GoldenStore.open(tmp_path / "g", expected_model_sha256="ab" * 32)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit, message", [
    ({"prompts": []}, "no prompts, so the token tier would check nothing"),
    ({"prompts": [{"name": "p00", "tokens": [0, 1, 2]}] * 2}, r"prompt names repeat \(p00\)"),
    ({"greedy.tokens": torch.tensor([7])}, r"a token id outside the vocabulary 0..3"),
    ({"teacher.input_ids": torch.arange(3.0)}, "token ids must be 1-D int64"),
    ({"steps": 2}, "1 greedy tokens, the manifest says 2 steps"),
    ({"teacher.input_ids": torch.tensor([0, 1, 1])}, "the teacher input is not the prompt followed by the greedy"),
    ({"teacher.logits": torch.ones(2, 4)}, r"logits of shape \(2, 4\) and \(1, 4\), expected \(3, 4\)"),
    ({"greedy.logits": torch.tensor([[1.0, float("nan"), 1.0, 1.0]])}, "non-finite or non-float logits"),
    ({"greedy.logits": torch.tensor([[1.0, 1.0, 1.5, 1.0]])},
     r"greedy logits differ from the teacher-forced logits by 0.5 at step 0 \(limit 1e-09\): the engine's "
     "incremental decode disagrees with its own prefill"),
])
def test_contents_that_contradict_each_other_are_refused_at_open(tmp_path, edit, message):
    """Files whose hashes match but whose contents do not (rewritten with their hashes, or built by a broken
    engine): one GoldenError at open naming the prompt, not a traceback in each test or a failure blamed on the
    engine under test."""
    out = _write(tmp_path / "g", **edit)
    with pytest.raises(GoldenError) as e:
        GoldenStore.open(out)
    assert "\n" not in str(e.value)
    e.match(message)
    if "prompts" not in edit:
        e.match("prompt p00: ")


def test_greedy_against_teacher_tolerance_follows_the_dtype(tmp_path):
    """float64 goldens agree to ~3e-14 (the bundled store): 1e-9 of the logits' scale; a float32-built store gets
    the float32 profile's prefill-vs-decode limit (1e-4)."""
    off = {"greedy.logits": torch.tensor([[1.0, 1.0, 1.0 + 2**-15, 1.0]])}  # 3.05e-5, exact in float32
    GoldenStore.open(_write(tmp_path / "a", dtype="float32", **off))
    with pytest.raises(GoldenError, match="by 3.05e-05 at step 0"):
        GoldenStore.open(_write(tmp_path / "b", **off))


def test_the_bundled_goldens_are_consistent():
    """The shipped store passes the same checks (its greedy logits were once recorded by a decode that disagreed
    with its prefill on 6 of 16 prompts, and the suite passed anyway)."""
    from pytest_cdna2.goldens import BUNDLED_GOLDENS

    store = GoldenStore.open(BUNDLED_GOLDENS)
    assert len(store.prompts) == 16


def test_regen_refuses_the_bundled_store_and_unlisted_files(tmp_path):
    from pytest_cdna2.goldens import BUNDLED_GOLDENS

    with pytest.raises(GoldenError, match="is the golden store bundled with pytest-cdna2; refusing to rewrite it"):
        GoldenWriter(BUNDLED_GOLDENS, regen=True)
    out = _write(tmp_path / "g")
    (out / "NOTES.txt").write_text("mine")
    with pytest.raises(GoldenError, match=r"holds files its manifest.json does not list \(NOTES.txt\); regen "
                                          "replaces the whole folder, so move them out first"):
        _write(out, regen=True, value=2.0)
    assert (out / "NOTES.txt").read_text() == "mine"
    assert torch.equal(GoldenStore.open(out).teacher_logits("p00"), torch.ones(3, 4))
