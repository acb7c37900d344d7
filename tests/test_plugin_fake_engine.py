"""A tiny fake engine with the Model API: ``--cdna2-engine=test_plugin_fake_engine:make_model``.

It lets the plugin's tests run without the bundled model: a causal bag-of-embeddings "model" whose weights
come from a seed in ``fake.json``, fast and deterministic, with taps and router selections of the right
shapes. The tests at the bottom check that it honours the contract the plugin relies on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

LOADS: list[tuple[str, str, str]] = []  # (path, device, backend) of every make_model call

# pytester inner runs without two plugins that cost ~1.5 s a run here: unraisableexception's gc.collect() calls
# (slow with torch imported) and hypothesis' summary hook (re-imports hypothesis, which pytester unloads); and
# without pytest-benchmark, which warns in every inner run when the outer run uses xdist.
FAST = ("-p", "no:unraisableexception", "-p", "no:hypothesispytest", "-p", "no:benchmark")


def run_inprocess(pytester, *args):
    """``pytester.runpytest_inprocess`` without the slow plugins, on the CPU unless ``args`` say otherwise
    (the default device is the first GPU where there is one)."""
    return pytester.runpytest_inprocess(*FAST, "--cdna2-device=cpu", *args)


@dataclass
class Selection:
    indices: torch.Tensor
    margin: torch.Tensor


@dataclass
class Trace:
    logits: torch.Tensor
    selections: dict = field(default_factory=dict)
    taps: dict = field(default_factory=dict)


@dataclass
class Generation:
    tokens: torch.Tensor
    logits: torch.Tensor


class FakeModel:
    """Logits = head(tanh-stack(mean of embeddings so far)); hc = 2 copies of the hidden state per tap."""

    def __init__(self, path: str, device: str = "cpu", seed: int = 0, vocab: int = 260, layers: int = 2,
                 dim: int = 8, bias: float = 0.0):
        self.path, self.device, self.dtype = Path(path), torch.device(device), torch.float64
        self.config = SimpleNamespace(num_hidden_layers=layers, vocab_size=vocab)
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
        self.w = [torch.randn(dim, dim, generator=g, dtype=torch.float64) / dim**0.5 for _ in range(layers)]
        self.router = [torch.randn(dim, 4, generator=g, dtype=torch.float64) for _ in range(layers)]
        self.head = torch.randn(dim, vocab, generator=g, dtype=torch.float64) * 3
        self.bias = bias

    def checkpoint_sha256(self) -> str:
        return hashlib.sha256((self.path / "fake.json").read_bytes()).hexdigest()

    def trace(self, input_ids, *, taps=(), selections=None):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # ops this small run ~100x slower on 2 busy cores with intra-op threads
        try:
            return self._trace(input_ids, taps)
        finally:
            torch.set_num_threads(threads)

    def _trace(self, input_ids, taps):
        ids = input_ids.cpu()
        T = ids.shape[1]
        h = self.emb[ids].cumsum(1) / torch.arange(1, T + 1, dtype=torch.float64)[None, :, None]
        out_taps, sels = {}, {}
        for i, w in enumerate(self.w):
            scores = h @ self.router[i]  # [B, T, 4]
            top = scores.topk(3, dim=-1).values
            sels[(i, "router")] = Selection(scores.topk(2, dim=-1).indices, top[..., 1] - top[..., 2])
            if f"{i}.attn" in taps:
                out_taps[f"{i}.attn"] = torch.stack([h, 2 * h], 2)
            h = h + torch.tanh(h @ w)
            if f"{i}.ffn" in taps:
                out_taps[f"{i}.ffn"] = torch.stack([h, 2 * h], 2)
        return Trace(h @ self.head + self.bias, sels, out_taps)

    def forward(self, input_ids, *, selections=None):
        return self.trace(input_ids).logits

    def generate(self, input_ids, max_new_tokens, *, taps=()):
        ids, toks, logits = input_ids, [], []
        for _ in range(max_new_tokens):
            last = self.forward(ids)[:, -1]
            nxt = last.argmax(-1, keepdim=True)
            toks.append(nxt)
            logits.append(last)
            ids = torch.cat([ids, nxt], 1)
        return Generation(torch.cat(toks, 1), torch.stack(logits, 1))


def make_model(path: str, *, device: str = "cpu", backend: str = "reference", dtype=None) -> FakeModel:
    """The ``module:factory`` entry: reads ``fake.json`` (seed, bias) from the checkpoint folder."""
    LOADS.append((path, str(device), backend))
    cfg = json.loads((Path(path) / "fake.json").read_text())
    return FakeModel(path, device, **cfg)


def write_fake_model(folder: Path, **cfg) -> Path:
    """A fake checkpoint folder (the fake's own fake.json, no config.json: only the bundled engine needs one);
    different ``cfg`` -> a different checkpoint sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fake.json").write_text(json.dumps(cfg))
    return folder


def test_fake_engine_honours_the_model_api(tmp_path):
    m = make_model(str(write_fake_model(tmp_path / "m", seed=1)))
    ids = torch.tensor([[104, 101, 108, 108, 111]])
    gen = m.generate(ids, 4)
    assert gen.tokens.shape == (1, 4) and gen.logits.shape == (1, 4, 260)
    tr = m.trace(torch.cat([ids, gen.tokens[:, :-1]], 1), taps=("0.attn", "1.ffn"))
    assert tr.taps["0.attn"].shape == (1, 8, 2, 8)
    assert tr.selections[(1, "router")].indices.shape == (1, 8, 2)
    # teacher-forced logits over prompt + continuation reproduce the greedy logits
    torch.testing.assert_close(tr.logits[0, 4:], gen.logits[0], rtol=1e-12, atol=1e-12)


def test_build_goldens_on_the_fake_engine_round_trips(tmp_path):
    from pytest_cdna2.goldens import GoldenStore, build_goldens

    folder = write_fake_model(tmp_path / "m", seed=2)
    model = make_model(str(folder))
    store = build_goldens(folder, tmp_path / "g", [b"abc", "d\u00e9f"], 3, model=model, progress=False)
    again = GoldenStore.open(tmp_path / "g", expected_model_sha256=model.checkpoint_sha256())
    assert [p.name for p in again.prompts] == ["p00", "p01"]
    assert again.prompt("p01").tokens == tuple("d\u00e9f".encode())
    ids = again.input_ids("p00")
    assert ids.tolist()[:3] == [97, 98, 99] and len(ids) == 3 + 3 - 1
    torch.testing.assert_close(again.teacher_logits("p00"), model.forward(ids[None])[0])
    assert torch.equal(again.greedy_tokens("p00"), model.generate(ids[None, :3], 3).tokens[0])
    assert list(again.taps("p00")) == ["0.attn", "0.ffn", "1.attn", "1.ffn"]
    sel = again.selections("p00")[(1, "router")]
    assert sel.indices.shape == (5, 2) and sel.margin.shape == (5,)
    assert store.manifest["dtype"] == "float64" and store.steps == 3
    assert set(store.manifest["files"]) == {"teacher.safetensors", "greedy.safetensors", "taps.safetensors",
                                            "selections.safetensors"}
