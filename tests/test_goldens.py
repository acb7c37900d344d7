"""The golden store: checksums, model identity, one-line errors, atomic and never-silent writes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pytest_cdna2.goldens import (
    BUNDLED_GOLDENS,
    MANIFEST,
    GoldenError,
    GoldenStore,
    GoldenWriter,
    build_goldens,
    decode_tokens,
    encode_prompt,
    load_prompts,
    sha256_file,
)

SHA_A, SHA_B = "a" * 64, "b" * 64


def _write(out, regen=False, value=1.0, model_sha=SHA_A, logits_dtype=torch.float64, extra=None, **edit):
    """A complete one-prompt store: prompt [0, 1, 2], one greedy step (token 3), vocabulary 4; the greedy logits
    are the teacher's at the last prompt position. `edit` replaces tensors ("teacher.KEY" / "greedy.KEY") or
    manifest fields; `extra` adds files or tensors by their full keys ({"taps": {"p00.0.attn": t}})."""
    logits = torch.full((3, 4), value, dtype=logits_dtype)
    files = {"teacher": {"p00.logits": logits, "p00.input_ids": torch.arange(3)},
             "greedy": {"p00.tokens": torch.tensor([3]), "p00.logits": logits[2:].clone()}}
    for file, tensors in (extra or {}).items():
        files.setdefault(file, {}).update(tensors)
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
    assert torch.equal(store.teacher_logits("p00"), torch.ones(3, 4, dtype=torch.float64))
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
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "manifest.json").write_text("[1, 2]")
    with pytest.raises(GoldenError, match=r"manifest.json: a JSON list, not a golden manifest \(an object with"):
        GoldenStore.open(tmp_path / "listed")
    out = _write(tmp_path / "g")
    store = GoldenStore.open(out)
    with pytest.raises(GoldenError, match=r"no tensor 'p09.logits': the store is incomplete or older than this check"):
        store.teacher_logits("p09")
    with pytest.raises(GoldenError, match=r"no file 'taps.safetensors' in manifest.json"):
        store.keys("taps.safetensors")
    assert store.taps("p00") == {} and store.selections("p00") == {}  # a store built without them
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
    ({"vocab_size": "256"}, "'vocab_size' must be a positive integer, got '256'"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer, got 0"),
    ({"steps": "x"}, "'steps' must be a count or a list of counts"),
    ({"dtype": "int64"}, "'dtype' must name the logits' floating dtype"),
    ({"dtype": None}, "'dtype' must name the logits' floating dtype"),
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
    assert torch.equal(GoldenStore.open(out).teacher_logits("p00"), torch.full((3, 4), 2.0, dtype=torch.float64))
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
    # without regen too: "goldens already exist ... pass --regen" named a fix that the rebuild then refused
    with pytest.raises(GoldenError, match=r"model is not empty and has no manifest.json.*pass a new or empty folder"):
        _write(model)
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


def test_token_id_prompts(tmp_path):
    """Prompts as token ids (a real model's tokenizer made them: byte-level ids are arbitrary tokens in V4-Flash's
    vocabulary): taken as given, range-checked against the model's vocabulary, and mixable with text in a file."""
    assert encode_prompt([0, 129279, 5], vocab_size=129280).tolist() == [0, 129279, 5]
    with pytest.raises(ValueError, match="token id 129280 is outside the model's vocabulary of 129280"):
        encode_prompt([1, 129280], vocab_size=129280)
    for bad in ([], [1, -2], [1, 2.0], [True]):
        with pytest.raises(ValueError, match="non-empty list of token ids >= 0"):
            encode_prompt(bad)
    assert encode_prompt([7, 9], vocab_size=100).tolist() == [7, 9]  # no byte-level vocabulary rule for ids
    (tmp_path / "p.json").write_text(json.dumps([[100, 200000, 3], "ab"]))
    assert load_prompts(tmp_path / "p.json") == [[100, 200000, 3], b"ab"]
    for bad in ([[]], [[1, "2"]], [[1.5]], [[-1]], [[True]]):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(GoldenError, match="or of non-empty token-id lists"):
            load_prompts(tmp_path / "bad.json")


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
    ({"greedy.logits": torch.tensor([[1.0, float("nan"), 1.0, 1.0]], dtype=torch.float64)}, "non-finite logits"),
    ({"logits_dtype": torch.float16}, r"logits of dtype torch.float16 and torch.float16 from the manifest's"
                                      " float64 run"),
    ({"logits_dtype": torch.float32}, r"logits of dtype torch.float32 and torch.float32 from the manifest's"
                                      " float64 run"),
    ({"dtype": "bfloat16"}, r"logits of dtype torch.float64 and torch.float64 from the manifest's"
                            " bfloat16 run"),
    ({"greedy.logits": torch.tensor([[1.0, 1.0, 1.5, 1.0]], dtype=torch.float64)},
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


NAN = float("nan")
SEL = {"p00.1.router.indices": torch.tensor([[0, 1], [2, 3], [1, 2]]), "p00.1.router.margin": torch.ones(3),
       "p00.1.indexer.indices": torch.tensor([[-1], [-1], [-1]]), "p00.1.indexer.margin": torch.full((3,), torch.inf)}
RANK = {"p00.1.router.ranked": torch.tensor([[0, 1, 2], [2, 3, 0], [1, 2, 3]]),  # the picks first, margin 1
        "p00.1.router.scores": torch.tensor([[2.5, 2.0, 1.0]] * 3)}
CONFIG = SimpleNamespace(num_hidden_layers=2, n_routed_experts=4, compress_ratios=[0, 1])


@pytest.mark.parametrize("extra, config, message", [
    ({"teacher": {"p01.logits": torch.ones(2, 4)}}, None,
     r"teacher.safetensors: tensors of prompts manifest.json does not list \(p01\)"),
    ({"greedy": {"p00.bogus": torch.ones(1)}}, None, r"greedy.safetensors: unexpected tensors \(p00.bogus\)"),
    ({"notes": {"p00.logits": torch.ones(1)}}, None, r"manifest.json lists notes.safetensors, not golden files"),
    ({"taps": {"p00.0.attn": torch.tensor([[1.0, NAN]] * 3)}}, None, r"tap p00.0.attn: non-finite values"),
    ({"taps": {"p00.0.attn": torch.ones(2, 2)}}, None, r"tap p00.0.attn: \(2, 2\) torch.float32, expected a float "
     "tensor of 3 rows"),
    ({"taps": {"p00.0.attn": torch.ones(3, 2), "p00.1.ffn": torch.ones(3, 2)}}, None, None),
    ({"taps": {"p00.block3.mlp_out": torch.ones(3, 2)}}, None, None),  # a user engine's own tap names
    ({"selections": SEL}, CONFIG, None),
    ({"selections": {**SEL, "p00.1.router.margin": torch.tensor([1.0, NAN, 1.0])}}, None,
     r"prompt p00: 1.router: margins \(3,\) torch.float32, expected 3 floats >= 0"),
    ({"selections": {k: v for k, v in SEL.items() if k != "p00.1.router.margin"}}, None,
     r"p00.1.router.indices has no p00.1.router.margin"),
    ({"selections": {**SEL, "p00.1.router.indices": torch.tensor([[0, 1], [2, 3], [1, 9]])}}, None, None),
    ({"selections": {**SEL, "p00.1.router.indices": torch.tensor([[0, 1], [2, 3], [1, 9]])}}, CONFIG,
     r"prompt p00: 1.router: expert ids 0..9, the model has 4"),
    ({"selections": {**SEL, "p00.1.router.indices": torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)}},
     None, r"1.router: indices \(3, 2\) torch.int32, expected int64 \[3, k\]"),
    ({"selections": {**SEL, "p00.1.indexer.indices": torch.tensor([[0], [1], [3]])}}, CONFIG,
     r"1.indexer: entries not yet closed at their position \(ratio 1\)"),
    ({"selections": {**SEL, "p00.1.indexer.indices": torch.tensor([[0], [1], [2]])}}, CONFIG, None),
    ({"selections": {"p00.0.indexer.indices": torch.tensor([[-1]] * 3), "p00.0.indexer.margin": torch.ones(3)}},
     CONFIG, r"0.indexer: an indexer selection on a layer without compressed attention"),
    ({"selections": {"p00.5.router.indices": torch.tensor([[0]] * 3), "p00.5.router.margin": torch.ones(3)}},
     None, r"5.router: layer 5, the model has 2"),
    ({"selections": {**SEL, **RANK}}, CONFIG, None),
    ({"selections": {**SEL, **RANK, "p00.1.router.ranked": torch.tensor([[0, 1, 2], [2, 3, 0], [1, 2, 4]])}},
     CONFIG, r"1.router: expert ids 0..4, the model has 4"),
    # a ranking the near-tie band cannot be read from (a review's store: margin 1, every score 0, passed a swap)
    ({"selections": {**SEL, **RANK, "p00.1.router.scores": torch.zeros(3, 3)}}, None,
     r"1.router: margins that are not the k-th minus the \(k\+1\)-th ranked score"),
    ({"selections": {**SEL, **RANK, "p00.1.router.ranked": torch.tensor([[0, 1, 2], [2, 3, 0], [1, 3, 2]])}},
     None, r"1.router: ranked entries that do not start with the picks"),
    ({"selections": {**SEL, **RANK, "p00.1.router.ranked": torch.tensor([[0, 1, 1], [2, 3, 0], [1, 2, 3]])}},
     None, r"1.router: ranked entries repeated within a position"),
    ({"selections": {**SEL, **RANK, "p00.1.router.scores": torch.tensor([[2.5, 2.0, 1.0], [2.0, 2.5, 1.5],
                                                                            [2.5, 2.0, 1.0]])}},
     None, r"1.router: scores not in descending order"),
    ({"selections": {**SEL, **RANK, "p00.1.router.ranked": torch.tensor([[0, 1, -1], [2, 3, 0], [1, 2, 3]])}},
     None, r"1.router: ranked -1 \(none\) and -inf scores at different places"),
    ({"selections": {**SEL, "p00.1.router.ranked": torch.tensor([[0], [2], [1]]),
                     "p00.1.router.scores": torch.ones(3, 1)}}, None, r"1.router: ranked 1 entries, fewer than the 2"),
    ({"selections": {**SEL, **RANK, "p00.1.router.ranked": torch.tensor([[0, 1, -2]] * 3)}}, None,
     r"1.router: ranked \(3, 3\) torch.int64, expected int64 \[3, r\] \(-1: none\)"),
    ({"selections": {**SEL, **RANK, "p00.1.router.ranked": torch.tensor([[0, 1, 2]] * 3, dtype=torch.int32)}},
     None, r"1.router: ranked \(3, 3\) torch.int32, expected int64"),
    ({"selections": {**SEL, **RANK, "p00.1.router.ranked": torch.tensor([[0, 1, 2]] * 2)}}, None,
     r"1.router: ranked \(2, 3\) torch.int64, expected int64 \[3, r\]"),
    ({"selections": {**SEL, **RANK, "p00.1.router.scores": torch.ones(3, 2)}}, None,
     r"1.router: scores \(3, 2\) torch.float32, expected floats \(no NaN, \+inf\) like ranked"),
    ({"selections": {**SEL, **RANK, "p00.1.router.scores": torch.tensor([[1.0, NAN, 0.0]] * 3)}}, None,
     r"1.router: scores \(3, 3\) torch.float32, expected floats"),
    ({"selections": {**SEL, "p00.1.router.ranked": RANK["p00.1.router.ranked"]}}, None,
     r"1.router: ranked without scores"),
    ({"selections": {**SEL, "p00.1.indexer.ranked": torch.tensor([[-1], [2], [-1]]),
                     "p00.1.indexer.scores": torch.tensor([[-torch.inf], [0.0], [-torch.inf]])}}, CONFIG,
     r"1.indexer: entries not yet closed at their position \(ratio 1\)"),
    ({"selections": {**SEL, "p00.0.router.ranked": torch.tensor([[1, 2]] * 3)}}, None,
     r"p00.0.router.ranked has no p00.0.router.indices"),
    ({"selections": {**SEL, "p00.0.router.margin": torch.ones(3)}}, None,
     r"p00.0.router.margin has no p00.0.router.indices"),
])
def test_taps_selections_and_stray_tensors_are_checked_at_open(tmp_path, extra, config, message):
    """A NaN golden tap, a selection the engine cannot take (an expert id past the model's, an entry not yet
    closed, int32 ids, a margin missing or NaN, ranked entries of the wrong shape or range, scores with NaN, a
    margin or ranking without the picks it belongs to) and tensors of prompts dropped from the manifest are
    refused at open, not met as "every tap within limits", a RuntimeError deep in the engine, or never."""
    out = _write(tmp_path / "g", extra=extra, num_hidden_layers=2)
    if message is None:
        GoldenStore.open(out, config=config)
        return
    with pytest.raises(GoldenError, match=message) as e:
        GoldenStore.open(out, config=config)
    assert "\n" not in str(e.value)


def test_taps_follow_tap_prompts(tmp_path):
    two = {"prompts": [{"name": "p00", "tokens": [0, 1, 2]}, {"name": "p01", "tokens": [0, 1, 2]}]}
    copy = {"p01.logits": torch.ones(3, 4, dtype=torch.float64), "p01.input_ids": torch.arange(3)}
    greedy = {"p01.tokens": torch.tensor([3]), "p01.logits": torch.ones(1, 4, dtype=torch.float64)}
    extra = {"teacher": copy, "greedy": greedy, "taps": {"p01.0.attn": torch.ones(3, 2)}}
    out = _write(tmp_path / "g", extra=extra, tap_prompts=1, **two)
    with pytest.raises(GoldenError, match=r"taps for prompts p01, expected the same taps for p00 \(tap_prompts 1\)"):
        GoldenStore.open(out)


def test_a_golden_file_the_manifest_does_not_list_is_refused(tmp_path):
    """Dropping selections.safetensors from the manifest (or leaving another .safetensors in the store) is one error
    at open: the file would otherwise go unchecked and unused. Other files (a README) are no golden: left alone."""
    out = _write(tmp_path / "g", extra={"selections": SEL})
    (out / "README.txt").write_text("built on the lab's MI250")
    (out / ".DS_Store").write_bytes(b"\0")
    GoldenStore.open(out)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["files"]["selections.safetensors"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(GoldenError, match=r"holds golden files its manifest.json does not list "
                                          r"\(selections.safetensors\)"):
        GoldenStore.open(out)
    manifest["files"].pop("teacher.safetensors")
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(GoldenError, match=r"manifest.json does not list teacher.safetensors"):
        GoldenStore.open(out)


@pytest.mark.parametrize("run", ["bfloat16", "float16", "float32"])
def test_a_store_of_a_lower_precision_run_holds_float32_logits(tmp_path, run):
    """The bundled engine returns float32 logits from a bf16, fp16 or float32 run: such a store opens."""
    GoldenStore.open(_write(tmp_path, dtype=run, logits_dtype=torch.float32))


def test_greedy_against_teacher_tolerance_follows_the_dtype(tmp_path):
    """float64 goldens agree to ~3e-14 (the bundled store): 1e-9 of the logits' scale; a float32-built store gets
    the float32 profile's prefill-vs-decode limit (1e-4)."""
    off = torch.tensor([[1.0, 1.0, 1.0 + 2**-15, 1.0]])  # 3.05e-5, exact in float32
    GoldenStore.open(_write(tmp_path / "a", dtype="float32", logits_dtype=torch.float32, **{"greedy.logits": off}))
    with pytest.raises(GoldenError, match="by 3.05e-05 at step 0"):
        GoldenStore.open(_write(tmp_path / "b", **{"greedy.logits": off.double()}))


def test_the_bundled_goldens_are_consistent():
    """The shipped store passes the same checks (its greedy logits were once recorded by a decode that disagreed
    with its prefill on 6 of 16 prompts, and the suite passed anyway)."""
    from pytest_cdna2.goldens import BUNDLED_GOLDENS

    store = GoldenStore.open(BUNDLED_GOLDENS)
    assert len(store.prompts) == 16
    for p in store.prompts:  # every selection ranks its picks first, best first, its margin the k-th/(k+1)-th gap
        for key, sel in store.selections(p.name).items():
            k = sel.indices.shape[1]
            assert sel.ranked is not None and sel.ranked.shape[1] > k, (p.name, key)
            assert (sel.ranked[:, :k].sort(-1).values == sel.indices.sort(-1).values).all(), (p.name, key)
            assert (sel.scores[:, :-1] >= sel.scores[:, 1:]).all(), (p.name, key)
            gap = (sel.scores[:, k - 1] - sel.scores[:, k]).nan_to_num(nan=torch.inf, posinf=torch.inf)  # none: inf
            torch.testing.assert_close(gap, sel.margin, rtol=0, atol=1e-12, msg=f"{p.name} {key}")


def test_regen_refuses_the_bundled_store_and_unlisted_files(tmp_path):
    from pytest_cdna2.goldens import BUNDLED_GOLDENS

    for regen in (True, False):  # without regen too: "pass --regen" would send the user to this refusal
        with pytest.raises(GoldenError, match="is the golden store bundled with pytest-cdna2; refusing to rewrite "
                                              "it: build into another folder"):
            GoldenWriter(BUNDLED_GOLDENS, regen=regen)
    out = _write(tmp_path / "g")
    (out / "NOTES.txt").write_text("mine")
    with pytest.raises(GoldenError, match=r"holds files its manifest.json does not list \(NOTES.txt\); regen "
                                          "replaces the whole folder, so move them out first"):
        _write(out, regen=True, value=2.0)
    with pytest.raises(GoldenError, match=r"does not list \(NOTES.txt\)"):  # not "pass --regen", which would refuse
        _write(out, value=2.0)
    assert (out / "NOTES.txt").read_text() == "mine"
    (out / "NOTES.txt").unlink()  # a store holds nothing its manifest does not list
    assert torch.equal(GoldenStore.open(out).teacher_logits("p00"), torch.ones(3, 4, dtype=torch.float64))


def test_a_file_dropped_into_the_store_during_a_rebuild_is_not_deleted(tmp_path):
    """The unlisted-files check ran when the rebuild started; a file written into the store while it computed
    must not go with the old store: the rebuild fails and keeps the old store, the file and nothing else."""
    out = _write(tmp_path / "g")
    before = (out / "teacher.safetensors").read_bytes()
    with pytest.raises(GoldenError, match=r"holds files its manifest.json does not list \(late.txt\); regen"):
        with GoldenWriter(out, regen=True) as w:
            w.write("teacher.safetensors", {"p00.logits": torch.zeros(1)})
            (out / "late.txt").write_text("mine")
    assert (out / "late.txt").read_text() == "mine"
    assert (out / "teacher.safetensors").read_bytes() == before
    assert _siblings(out) == ["g"]


def test_every_prompt_is_checked_before_any_compute(tmp_path):
    """An id outside the vocabulary in the third prompt stops the build naming that prompt before the first is
    generated (V4-Flash: hours of work), and nothing is written."""
    from test_plugin_fake_engine import make_model, write_fake_model

    model = make_model(str(write_fake_model(tmp_path / "m", seed=1)))
    calls = []
    model.generate = lambda *a, **k: calls.append(a) or pytest.fail("generated before the prompts were checked")
    with pytest.raises(ValueError, match="prompt p02: token id 999999 is outside the model's vocabulary of 260"):
        build_goldens(None, tmp_path / "g", [b"ok", [1, 2], [999999]], 2, model=model, progress=False)
    assert calls == [] and not (tmp_path / "g").exists()


def test_a_build_whose_decode_disagrees_names_the_float64_limit(tmp_path):
    """An engine that keeps float32 parts in a float64 run (transformers) disagrees with itself past float64's 1e-9:
    the refusal says so and names the way out (--dtype float32) instead of only "fix the engine"."""
    from test_plugin_fake_engine import make_model, write_fake_model

    model = make_model(str(write_fake_model(tmp_path / "m", seed=1)))
    generate = model.generate

    def float32_ish(ids, n):
        gen = generate(ids, n)
        gen.logits.add_(1e-6)  # float32-sized error on a float64 run
        return gen

    model.generate = float32_ish
    with pytest.raises(GoldenError, match=r"prompt p00: greedy logits differ .* fix the engine before building "
                                          r"goldens from it \(float64's limit is 1e-9: .* --dtype float32\)"):
        build_goldens(None, tmp_path / "g", [b"hello"], 3, model=model, progress=False)
    assert not (tmp_path / "g").exists()


def test_a_build_refuses_logits_its_store_would_refuse(tmp_path):
    """float64 logits from an engine run in float32 make a store that every load refuses (a relabelled float64
    store looks the same): the build stops at the first prompt, writing nothing, and says what the rule is."""
    from test_plugin_fake_engine import make_model, write_fake_model

    model = make_model(str(write_fake_model(tmp_path / "m", seed=1)))
    assert model.trace(torch.tensor([[1, 2]])).logits.dtype == torch.float64
    model.dtype = torch.float32
    with pytest.raises(GoldenError, match=r"prompt p00: the engine returned logits of dtype torch.float64 \(trace\) "
                                          r"and torch.float64 \(generate\) from a float32 run: a float64 run makes "
                                          r"float64 logits, any other run .* not float64"):
        build_goldens(None, tmp_path / "g", [b"hello"], 3, model=model, progress=False)
    assert not (tmp_path / "g").exists()


def test_a_build_with_non_finite_logits_writes_nothing(tmp_path):
    """An engine (or checkpoint) that makes NaN logits: the build names it at the prompt, before anything is
    written (a store of them was committed, then refused when reopened: it blocked the next build without
    --regen and failed `verify`)."""
    from test_plugin_fake_engine import make_model, write_fake_model

    model = make_model(str(write_fake_model(tmp_path / "m", seed=1)))
    generate, trace = model.generate, model.trace

    def nan_generate(ids, n):
        gen = generate(ids, n)
        gen.logits[..., 3] = float("nan")
        return gen

    def nan_trace(ids, **kw):
        tr = trace(ids, **kw)
        tr.logits[..., 3] = float("nan")
        return tr

    model.generate, model.trace = nan_generate, nan_trace
    with pytest.raises(GoldenError, match=r"prompt p00: the engine returned non-finite logits: fix the engine or "
                                          r"its checkpoint before building goldens from it$"):
        build_goldens(None, tmp_path / "g", [b"hello"], 3, model=model, progress=False)
    assert not (tmp_path / "g").exists() and not list(tmp_path.glob(".g.*"))


def test_the_writer_puts_no_store_in_place_that_its_check_refuses(tmp_path):
    def refuse(tmp) -> None:
        assert (tmp / MANIFEST).is_file()  # checked complete, before the rename
        raise GoldenError("refused")

    with pytest.raises(GoldenError, match="refused"):
        with GoldenWriter(tmp_path / "g", verify=refuse) as w:
            w.write("teacher.safetensors", {"p00.logits": torch.zeros(2, 3)})
    assert not (tmp_path / "g").exists() and not list(tmp_path.glob(".g.*"))


def test_steps_text_names_each_prompts_steps_where_they_differ(tmp_path):
    """Messages said "2 prompts, 3 steps" for a store of 3 and 2 steps (`steps` is the most)."""
    from test_plugin_fake_engine import make_model, write_fake_model

    model = make_model(str(write_fake_model(tmp_path / "m", seed=1)))
    differ = build_goldens(None, tmp_path / "g", [b"hi", b"yo"], [3, 2], model=model, progress=False)
    same = build_goldens(None, tmp_path / "h", [b"hi", b"yo"], [2, 2], model=model, progress=False)
    assert (differ.steps, differ.steps_text, same.steps_text) == (3, "3,2", "2")


def test_the_float64_hint_is_for_other_engines_only(tmp_path):
    """The bundled engine's float64 decode disagreeing with its prefill is a bug in it: no hint to work around it."""
    import cdna2_engine

    model = cdna2_engine.load_model(str(BUNDLED_GOLDENS.parent / "model"), dtype="float64")
    generate = model.generate

    def off(ids, n):
        gen = generate(ids, n)
        gen.logits.add_(1e-6)
        return gen

    model.generate = off
    with pytest.raises(GoldenError, match=r"fix the engine before building goldens from it$"):
        build_goldens(None, tmp_path / "g", [b"hello"], 2, model=model, progress=False)


def test_model_identity_falls_back_to_the_official_folder(tmp_path):
    """An engine that names no sha256, or whose config lacks V4's fields (transformers'), is tied to the folder's
    sha256 and bounded by its config.json; an engine that names both keeps its own; a folder in an engine's own
    format (no config.json) gives what the engine gives."""
    from types import SimpleNamespace as NS

    from cdna2_engine.checkpoint import checkpoint_sha256
    from cdna2_engine.config import Config
    from pytest_cdna2.goldens import model_identity

    from tiny_configs import make_checkpoint, make_config

    folder = make_checkpoint(tmp_path / "m", make_config("csa-only"), seed=1)
    sha, cfg = model_identity(NS(config=NS(vocab_size=97)), folder)
    assert sha == checkpoint_sha256(folder) and isinstance(cfg, Config) and cfg.compress_ratios == [4, 4]
    own = NS(checkpoint_sha256=lambda: "ab" * 32, config=NS(compress_ratios=[0]))
    assert model_identity(own, folder) == ("ab" * 32, own.config)
    assert model_identity(NS(config=NS(vocab_size=97)), tmp_path) == (None, NS(vocab_size=97))
