"""Crafted GGUF headers (issue 16): every kind ends fast, in bounded memory, with one ``error:`` line.

Each hostile file is the synthetic tiny qwen3moe with raw header bytes rewritten by
tests/gguf_craft.py. The CLI runs in a child process (``python -m moecache.cli.main``) under a 4 GiB
address-space limit (a safety net: a regression fails instead of swapping the CI machine), and the
test asserts a non-zero exit, exactly one line starting ``error:`` that names the culprit, no
traceback, the wall time, and the child's peak RSS. The message check matters: an allocation that
hits the limit would also print one ``error:`` line (out of memory), but not the culprit's name.

Each kind is tried with several commands (info, run, perplexity, bench) and, in-process through
``open_gguf`` (fast), with other keys and sizes.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gguf_craft import ARRAY, FLOAT32, STRING, UINT8, UINT32, UINT64, Crafted, array_head, nested_array
from moecache.errors import GGUFError, NonFiniteError
from moecache.gguf_file import MAX_ARRAY_DEPTH, open_gguf

ROOT = Path(__file__).resolve().parents[1]
AS_LIMIT = 4 << 30  # address space of the child CLI (it needs ~1.2 GiB of mappings to run the tiny model)
RSS_LIMIT = 600 << 20  # its peak resident memory; a normal run of the tiny model takes ~180 MiB
# Runs the CLI as its own child under the limit, then reports that child's peak RSS on stderr.
_WRAPPER = """
import resource, subprocess, sys
def limit():
    if {lim}:
        resource.setrlimit(resource.RLIMIT_AS, ({lim}, {lim}))
p = subprocess.run([sys.executable, "-m", "moecache.cli.main", *sys.argv[1:]], preexec_fn=limit)
print("maxrss_kb=%d" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(p.returncode)
"""
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away. " * 30

A = "qwen3moe"  # the tiny preset's architecture


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from moecache.testing.synth import PRESETS, write_model

    p = tmp_path_factory.mktemp("hostile") / "tiny.gguf"
    write_model(p, PRESETS["tiny"], seed=0)
    return p


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text(TEXT)
    return p


def _cli_args(command: str, model: Path, text: Path | None = None, *extra: str) -> list[str]:
    """A short invocation of ``command`` on ``model`` (CPU only, few tokens)."""
    base = {"info": ["info", "-m", str(model)],
            "run": ["run", "-m", str(model), "-p", "hello", "-n", "4", "--temp", "0", "-ngl", "0"],
            "perplexity": ["perplexity", "-m", str(model), "-f", str(text), "-c", "16", "-ngl", "0"],
            "bench": ["bench", "-m", str(model), "-p", "8", "-n", "4", "-r", "1", "-ngl", "0"]}[command]
    return base + list(extra)


def run_cli(args: list[str], timeout: float = 120, as_limit: int = AS_LIMIT) -> tuple[int, str, str, float, int]:
    """(exit code, stdout, stderr without the RSS line, wall seconds, peak RSS bytes) of the CLI, run by
    a small wrapper process (a child's ru_maxrss after exec counts the memory of the process it was
    spawned from: pytest's, here) under an address-space limit of ``as_limit`` bytes (0: none)."""
    # CUDA reserves more address space than the limit; so would a thread pool (and its malloc arenas)
    # per core on a many-core machine
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NUMBA_NUM_THREADS="2", OMP_NUM_THREADS="2",
               MALLOC_ARENA_MAX="2")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _WRAPPER.format(lim=as_limit), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    lines = p.stderr.rstrip("\n").split("\n")
    assert lines[-1].startswith("maxrss_kb="), p.stderr
    return p.returncode, p.stdout, "\n".join(lines[:-1]), wall, int(lines[-1].split("=")[1]) * 1024


def assert_one_error(args: list[str], *needles: str, max_s: float = 30.0) -> str:
    """Run the CLI; assert exit != 0, one ``error:`` line holding every needle, no traceback, at most
    ``max_s`` seconds and RSS_LIMIT of memory. Returns the error line."""
    rc, out, err, wall, rss = run_cli(args)
    print(f"{' '.join(args[:3])}: rc {rc}, {wall:.1f} s, peak RSS {rss / 2**20:.0f} MiB\n{err}")
    assert rc != 0, (out, err)
    assert "Traceback" not in err + out, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err
    for n in needles:
        assert n in errors[0], f"{n!r} not in {errors[0]!r}"
    assert wall < max_s, f"took {wall:.1f} s"
    assert rss < RSS_LIMIT, f"peak RSS {rss / 2**20:.0f} MiB"
    return errors[0]


def open_error(path: Path, *needles: str, exc: type = GGUFError) -> str:
    """open_gguf(path) raises ``exc`` with a one-line message holding every needle (within 5 s)."""
    t0 = time.perf_counter()
    with pytest.raises(exc) as ei:
        open_gguf(path)
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 600, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert time.perf_counter() - t0 < 5.0
    return msg


# ---- counts the file cannot hold ----------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["info", "run", "perplexity", "bench"])
def test_block_count_past_the_file_every_command(tiny, text, tmp_path, command):
    bad = Crafted.load(tiny).set(f"{A}.block_count", 1_000_000_000).write(tmp_path / "bc.gguf")
    assert_one_error(_cli_args(command, bad, text), f"{A}.block_count is 1000000000", "4 blocks")


@pytest.mark.parametrize("n", [5, 4096, 2**32 - 1])
def test_block_count_sizes(tiny, tmp_path, n):
    bad = Crafted.load(tiny).set(f"{A}.block_count", n).write(tmp_path / "bc.gguf")
    open_error(bad, f"block_count is {n}", "holds tensors of 4 blocks")


def test_block_count_counts_distinct_blocks(tiny, tmp_path):
    """A tensor named blk.999999999.* is one block, not a billion: the bound is the distinct blocks."""
    c = Crafted.load(tiny).set(f"{A}.block_count", 1_000_000_000)
    c.tensor("blk.3.attn_norm.weight")["name"] = "blk.999999999.attn_norm.weight"
    open_error(c.write(tmp_path / "far.gguf"), "block_count is 1000000000", "holds tensors of 5 blocks")


@pytest.mark.parametrize("key", ["expert_count", "embedding_length", "expert_feed_forward_length", "vocab_size",
                                 "attention.key_length", "attention.value_length"])
@pytest.mark.parametrize("value", [2**31 - 1, 2**32 - 1])
def test_sizes_checked_against_tensor_shapes(tiny, tmp_path, key, value):
    """Every size that shapes a tensor is compared with the tensors the file holds (no work sized
    by the claimed value first)."""
    bad = Crafted.load(tiny).set(f"{A}.{key}", value, UINT32).write(tmp_path / "k.gguf")
    open_error(bad, "tensor shapes do not match the hyperparameters", "expected (")


@pytest.mark.parametrize("key,value,needle", [
    ("attention.head_count", 2**31 - 1, "not a multiple of head_count_kv"),
    ("attention.head_count_kv", 2**31 - 1, "not a multiple of head_count_kv"),
    ("attention.head_count_kv", 0, "not a multiple of head_count_kv"),
    ("expert_used_count", 2**31 - 1, "must be in 1..expert_count"),
    ("rope.dimension_count", 2**31 - 1, "rope.dimension_count (2147483647) must be in 1..head size"),
    ("rope.dimension_count", 0, "rope.dimension_count (0) must be in 1..head size"),
    ("leading_dense_block_count", 2**31 - 1, "leading_dense_block_count (2147483647) must be in 0..block_count"),
    ("context_length", 0, "context_length is 0"),
    ("attention.value_length", 0, "attention.value_length is 0"),
    ("attention.sliding_window", -5, "attention.sliding_window is -5"),
])
def test_impossible_counts(tiny, tmp_path, key, value, needle):
    from gguf_craft import INT32

    bad = Crafted.load(tiny).set(f"{A}.{key}", value, INT32 if value < 0 else UINT32).write(tmp_path / "k.gguf")
    open_error(bad, needle)


@pytest.mark.parametrize("n_tensors,n_kv,needle", [
    (None, 2**62, "of 4611686018427387904"),
    (2**62, None, "tensor info 51 of 4611686018427387904"),
    (2**64 - 1, 2**64 - 1, "header is truncated"),
])
def test_header_counts_bounded_by_the_file(tiny, tmp_path, n_tensors, n_kv, needle):
    """Key/value and tensor counts: parsing stops at the first entry the file does not hold."""
    bad = Crafted.load(tiny).write(tmp_path / "counts.gguf", n_tensors=n_tensors, n_kv=n_kv)
    open_error(bad, needle)


@pytest.mark.timeout(300)
def test_many_small_entries_bounded(tiny, tmp_path):
    """A header packed with the smallest entries the format allows (150k one-byte key/values, 50k
    one-element tensors: a 4 MB file) is valid, and `info` reads it in seconds and a few hundred MB
    (gguf-py's numpy.memmap views cost ~7 s and ~600 MB for the key/values alone)."""
    c = Crafted.load(tiny)
    c.kvs += [[f"k{i}", UINT8, b"\0"] for i in range(150_000)]
    end = len(c.data)
    c.tensors += [{"name": f"x{i}", "dims": [1], "type": 0, "offset": end + 32 * i} for i in range(50_000)]
    c.data += bytes(32 * 50_000)
    rc, out, err, wall, rss = run_cli(["info", "-m", str(c.write(tmp_path / "many.gguf"))])
    print(f"info: {wall:.1f} s, peak RSS {rss / 2**20:.0f} MiB")
    assert rc == 0 and "qwen3moe" in out, err
    assert wall < 30 and rss < RSS_LIMIT


def test_tensor_info_dims_and_name_bounded(tiny, tmp_path):
    c = Crafted.load(tiny)
    c.tensor("blk.0.attn_k.weight")["dims"] = [64] * 5000  # n_dims read before 5000 dims are sliced
    open_error(c.write(tmp_path / "dims.gguf"), "'blk.0.attn_k.weight' has 5000 dimensions")
    c = Crafted.load(tiny)
    c.tensor("blk.0.attn_k.weight")["name"] = "x" * 100_000
    open_error(c.write(tmp_path / "name.gguf"), "name of 100000 bytes", "1..63")
    c = Crafted.load(tiny)
    c.tensor("blk.0.attn_k.weight")["dims"] = [2**62, 2**62]
    open_error(c.write(tmp_path / "ne.gguf"), "'blk.0.attn_k.weight' has impossible dimensions")


@pytest.mark.parametrize("raw,needle", [
    (struct.pack("<Q", 2**62) + b"abc", "metadata key 'x.key' needs bytes up to"),  # a string's length
    (None, "the 1125899906842624-element array 'x.key'"),
])
def test_string_lengths_bounded(tiny, tmp_path, raw, needle):
    c = Crafted.load(tiny)
    if raw is None:
        c.set_raw("x.key", ARRAY, array_head(STRING, 2**50) + bytes(1000))
    else:
        c.set_raw("x.key", STRING, raw)
    open_error(c.write(tmp_path / "s.gguf"), needle)


# ---- arrays: nesting and element counts ----------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["info", "run"])
def test_array_nested_5000_deep(tiny, text, tmp_path, command):
    bad = Crafted.load(tiny).set_raw("x.nested", ARRAY, nested_array(5000)).write(tmp_path / "nest.gguf")
    assert_one_error(_cli_args(command, bad, text), "'x.nested' nests arrays more than 16 deep")


def test_array_nesting_depth_limit(tiny, tmp_path):
    ok = Crafted.load(tiny).set_raw("x.nested", ARRAY, nested_array(MAX_ARRAY_DEPTH)).write(tmp_path / "ok.gguf")
    with open_gguf(ok) as m:
        v = m.metadata["x.nested"]
        for _ in range(MAX_ARRAY_DEPTH - 1):
            assert isinstance(v, list) and len(v) == 1
            v = v[0]
        assert v == []
        assert m.metadata.array_len("x.nested") == 1
    bad = Crafted.load(tiny).set_raw("x.nested", ARRAY, nested_array(MAX_ARRAY_DEPTH + 1)).write(tmp_path / "b.gguf")
    open_error(bad, f"nests arrays more than {MAX_ARRAY_DEPTH} deep")


def test_nested_array_values_decode(tiny, tmp_path):
    """Arrays of arrays (gguf-py can write them; llama.cpp refuses them) decode lazily to lists."""
    inner = [array_head(UINT32, 2) + struct.pack("<2I", 7, 8), array_head(STRING, 1) + struct.pack("<Q", 2) + b"hi"]
    c = Crafted.load(tiny).set_raw("x.mixed", ARRAY, array_head(ARRAY, 2) + b"".join(inner))
    with open_gguf(c.write(tmp_path / "mixed.gguf")) as m:
        assert m.metadata["x.mixed"] == [[7, 8], ["hi"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["info", "bench"])
def test_array_of_2_40_arrays_then_16_mib(tiny, text, tmp_path, command):
    """2^40 arrays of arrays need at least 12 bytes each: refused before the first is read (gguf-py
    took 106 s and 1.8 GB to walk 16 MiB of empty inner arrays)."""
    c = Crafted.load(tiny).set_raw("x.big", ARRAY, array_head(ARRAY, 2**40) + bytes(16 << 20))
    bad = c.write(tmp_path / "big.gguf")
    assert_one_error(_cli_args(command, bad, text), "1099511627776-element array 'x.big'", max_s=20)


@pytest.mark.parametrize("itype,count", [(UINT8, 2**63), (UINT64, 2**61), (FLOAT32, 10**12), (ARRAY, 2**40),
                                         (STRING, 2**40)])
def test_array_counts_bounded_by_the_file(tiny, tmp_path, itype, count):
    c = Crafted.load(tiny).set_raw("x.arr", ARRAY, array_head(itype, count) + bytes(4096))
    open_error(c.write(tmp_path / "a.gguf"), f"the {count}-element array 'x.arr'", "truncated")


def test_many_small_inner_arrays_stay_fast(tiny, tmp_path):
    """300k real (empty) inner arrays: parsed in well under a second, no per-element objects."""
    c = Crafted.load(tiny).set_raw("x.many", ARRAY, array_head(ARRAY, 300_000) + array_head(UINT8, 0) * 300_000)
    t0 = time.perf_counter()
    with open_gguf(c.write(tmp_path / "many.gguf")) as m:
        assert m.metadata.array_len("x.many") == 300_000
    assert time.perf_counter() - t0 < 3.0


# ---- the KV cache against RAM ---------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("command,extra", [
    ("run", ("-c", str(2**30))),          # -c itself is capped at 2^31 - 1 (int32) by its range
    ("perplexity", ("-c", str(2**30))),   # a later -c wins over _cli_args' -c 16
    ("bench", ("-c", str(2**30))),
])
def test_kv_cache_of_an_explicit_c_checked_against_ram(tiny, text, command, extra):
    assert_one_error(_cli_args(command, tiny, text, *extra), "KV cache of", "GiB of RAM", "pass -c")


@pytest.mark.timeout(300)
def test_trained_context_past_the_ram_is_lowered_with_a_note(tiny, tmp_path):
    """Without -c the context is the file's {arch}.context_length (2^31 here: 1 TiB of KV cache):
    it is lowered to the largest power of two that fits the available RAM, said in one note, and
    the run goes on (the KV cache is committed lazily: small RSS). Not under run_cli's address-space
    limit, which is smaller than the RAM the note sizes the context by."""
    model = Crafted.load(tiny).set(f"{A}.context_length", 2**31).write(tmp_path / "ctx.gguf")
    rc, out, err, wall, rss = run_cli(_cli_args("run", model), as_limit=0)
    print(err)
    assert rc == 0 and "Traceback" not in err
    notes = [ln for ln in err.splitlines() if "context lowered to" in ln]
    assert len(notes) == 1 and f"{A}.context_length = {2**31}" in notes[0]
    n = int(notes[0].split("context lowered to ")[1].split()[0])
    assert 256 <= n < 2**31 and n & (n - 1) == 0
    assert rss < RSS_LIMIT and wall < 60


def test_memory_error_is_one_line(monkeypatch, tiny):
    """A MemoryError from any allocation (numpy's "Unable to allocate ...") is a user error."""
    import moecache.cli.run
    from moecache.cli.main import app

    def boom(*a, **k):
        raise MemoryError("Unable to allocate 128. GiB for an array with shape (2147483648, 2, 16)")

    monkeypatch.setattr(moecache.cli.run, "run_command", boom)
    r = CliRunner().invoke(app, ["run", "-m", str(tiny), "-p", "x"])
    assert r.exit_code == 1 and not isinstance(r.exception, MemoryError), r.output
    assert r.output.strip().splitlines()[-1].startswith("error: out of memory: Unable to allocate 128. GiB")


# ---- tensor data layout ---------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["info", "run", "perplexity"])
def test_overlapping_tensor_data(tiny, text, tmp_path, command):
    c = Crafted.load(tiny)
    c.tensor("output_norm.weight")["offset"] = c.tensor("token_embd.weight")["offset"]
    bad = c.write(tmp_path / "overlap.gguf")
    assert_one_error(_cli_args(command, bad, text), "'output_norm.weight' has data offset 0, expected", "overlaps")


def test_tensor_data_out_of_order_or_gapped(tiny, tmp_path):
    c = Crafted.load(tiny)  # two tensor infos swapped: offsets no longer follow the info order
    i = next(i for i, t in enumerate(c.tensors) if t["name"] == "blk.0.attn_q.weight")
    c.tensors[i], c.tensors[i + 1] = c.tensors[i + 1], c.tensors[i]
    open_error(c.write(tmp_path / "swap.gguf"), f"'{c.tensors[i]['name']}' has data offset", "leaves a gap")
    c = Crafted.load(tiny)  # every offset after the first moved one alignment further: a gap
    for t in c.tensors[1:]:
        t["offset"] += 32
    c.data = c.data[:c.tensors[1]["offset"] - 32] + bytes(32) + c.data[c.tensors[1]["offset"] - 32:]
    open_error(c.write(tmp_path / "gap.gguf"), f"'{c.tensors[1]['name']}' has data offset", "expected")


def test_real_files_follow_the_layout(code_moe_tiny, gemma3_270m):
    """The layout rule is llama.cpp's: files llama.cpp wrote or loads pass it."""
    for p in (code_moe_tiny, gemma3_270m):
        with open_gguf(p) as m:
            assert len(m.tensors) > 50


def test_synthetic_presets_follow_the_layout(tmp_path):
    from moecache.testing.synth import PRESETS, write_model

    for name in ("tiny-gemma3", "tiny-qwen2moe", "tiny-llama"):
        write_model(tmp_path / f"{name}.gguf", PRESETS[name])
        with open_gguf(tmp_path / f"{name}.gguf") as m:
            assert m.config.arch == PRESETS[name].arch


# ---- non-finite weights and hyperparameters -------------------------------------------------------

def _nan_norm(tiny: Path, tmp_path: Path, name: str = "output_norm.weight", value: float = float("nan")) -> Path:
    c = Crafted.load(tiny)
    at = c.tensor_bytes(name).start + 4 * 3
    return c.patch_data(at, struct.pack("<f", value)).write(tmp_path / "nan.gguf")


def _nan_scale(tiny: Path, tmp_path: Path, name: str = "output.weight", row: int = 5) -> Path:
    """A NaN f16 scale in the first Q8_0 block of ``row`` of ``name``: one logit NaN for every token."""
    c = Crafted.load(tiny)
    t = c.tensor(name)
    assert t["type"] == 8  # Q8_0: f16 d, then 32 int8
    at = t["offset"] + row * (t["dims"][0] // 32 * 34)
    return c.patch_data(at, struct.pack("<e", float("nan"))).write(tmp_path / "nanscale.gguf")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command,extra", [("run", ()), ("run", ("--temp", "0.8")), ("perplexity", ()),
                                           ("info", ())])
def test_nan_in_a_norm_weight(tiny, text, tmp_path, command, extra):
    bad = _nan_norm(tiny, tmp_path)
    assert_one_error(_cli_args(command, bad, text, *extra), "'output_norm.weight' holds 1 non-finite values")


@pytest.mark.parametrize("name", ["blk.2.attn_norm.weight", "blk.0.attn_k_norm.weight", "blk.3.ffn_norm.weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_vectors_named_at_open(tiny, tmp_path, name, value):
    open_error(_nan_norm(tiny, tmp_path, name, value), f"'{name}' holds 1 non-finite values", "element 3",
               exc=NonFiniteError)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command,extra", [("run", ()), ("run", ("--temp", "0.8")), ("perplexity", ()),
                                           ("bench", ())])
def test_nan_in_a_matrix_is_non_finite_logits(tiny, text, tmp_path, command, extra):
    """A NaN inside a quantized matrix is found after a forward pass (the last row of its logits):
    `--temp 0` used to print token 0, sampling died on numpy's "Probabilities contain NaN"."""
    bad = _nan_scale(tiny, tmp_path)
    assert_one_error(_cli_args(command, bad, text, *extra), "non-finite logits", max_s=120)


def test_non_finite_logits_later_in_the_sequence(tiny, tmp_path):
    """A NaN only one token's embedding row holds: found at the position that token is evaluated."""
    from moecache.engine import Engine, EngineConfig

    bad = _nan_scale(tiny, tmp_path, "token_embd.weight", row=7)
    with Engine(bad, EngineConfig(n_ctx=64)) as eng:
        eng.eval([3, 4, 5])
        with pytest.raises(NonFiniteError, match="non-finite logits .* at position 4"):
            eng.eval([6, 7])


@pytest.mark.parametrize("key", ["attention.layer_norm_rms_epsilon", "rope.freq_base"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 0.0, -1e-6])
def test_impossible_positive_floats(tiny, tmp_path, key, value):
    bad = Crafted.load(tiny).set(f"{A}.{key}", value, FLOAT32).write(tmp_path / "f.gguf")
    open_error(bad, f"{A}.{key} is {float(np.float32(value))}", "must be finite and > 0")


@pytest.mark.parametrize("key", ["rope.scaling.factor", "expert_weights_scale", "final_logit_softcapping",
                                 "attn_logit_softcapping", "rope.freq_base_swa"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -2.0])
def test_impossible_scales(tiny, tmp_path, key, value):
    bad = Crafted.load(tiny).set(f"{A}.{key}", value, FLOAT32).write(tmp_path / "f.gguf")
    open_error(bad, f"{A}.{key} is {float(np.float32(value))}", "must be finite")


def test_unset_scales_still_load(tiny, tmp_path):
    """0 means unset for the scales (llama.cpp reads them so): still a valid file."""
    c = Crafted.load(tiny)
    for key in ("rope.scaling.factor", "expert_weights_scale", "final_logit_softcapping"):
        c.set(f"{A}.{key}", 0.0, FLOAT32)
    with open_gguf(c.write(tmp_path / "zero.gguf")) as m:
        assert m.config.expert_weights_scale == 0.0


def test_craft_helper_round_trips(tiny, tmp_path):
    """The helper writes back the same bytes it read, so every hostile file differs only where edited."""
    out = Crafted.load(tiny).write(tmp_path / "same.gguf")
    assert out.read_bytes() == tiny.read_bytes()
