"""``moecache run`` and ``moecache perplexity`` end to end, and their errors on bad input.

Perplexities are compared with llama-perplexity b11434 on the same text and -c
(tests/data/llamacpp/perplexity.json); greedy text with llama-simple's (greedy.json).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moecache.cli.main import app
from conftest import require_shared

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
runner = CliRunner()


def _llamacpp(kind: str, model: str, **match) -> dict:
    runs = json.loads((DATA / "llamacpp" / f"{kind}.json").read_text())["runs"]
    return next(r for r in runs if r["model"] == model and all(r.get(k) == v for k, v in match.items()))


def _final_ppl(output: str) -> tuple[float, float]:
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
    assert m, output
    return float(m.group(1)), float(m.group(2))


def test_perplexity_code_moe_tiny_within_1pct_of_llamacpp(code_moe_tiny):
    text = require_shared("heldout-b.py.txt")
    r = runner.invoke(app, ["perplexity", "-m", str(code_moe_tiny), "-f", str(text), "-c", "256", "-b", "256"])
    assert r.exit_code == 0, r.output
    ppl, err = _final_ppl(r.output)
    ref = 3.8860  # ../shared/models/README.md; our own b11434 build gave 3.8868 (perplexity.json)
    print(f"code-moe-tiny PPL {ppl:.4f} +/- {err:.5f} vs llama.cpp {ref} ({(ppl / ref - 1) * 100:+.3f}%)")
    assert abs(ppl / ref - 1) < 0.002  # issue: 1%; measured 0.03%. Tighter, so a shifted chunking shows
    assert "[29]" in r.output and "[30]" not in r.output  # 29 chunks, as llama-perplexity


def test_perplexity_gemma3_public_domain_text(gemma3_270m):
    """With an f32 KV cache (-ctk f32) our numerics equal transformers' PPL; with llama.cpp's roundings emulated (8-bit matmul
    activations, f16-table GELU), within 1% of llama-perplexity's value. Without them moecache is
    3.2% lower than llama.cpp here, as transformers is (tests/data/llamacpp/README.md)."""
    from moecache.engine import Engine, EngineConfig
    from moecache.testing.llamacpp_numerics import LlamaCppRoundingBackend

    text = DATA / "text" / "public-domain.txt"
    ref = _llamacpp("perplexity", "gemma-3-270m-q4_k_m.gguf", n_chunks=11)
    hf = json.loads((DATA / "transformers" / "perplexity.json").read_text())["runs"][0]["ppl"]
    r = runner.invoke(app, ["perplexity", "-m", str(gemma3_270m), "-f", str(text), "-c", "128", "-b", "128",
                            "-ctk", "f32", "-ctv", "f32"])
    assert r.exit_code == 0, r.output
    ppl, err = _final_ppl(r.output)
    assert "[11]" in r.output and "[12]" not in r.output
    with Engine(gemma3_270m, EngineConfig(n_ctx=128), backend=LlamaCppRoundingBackend()) as eng:
        emu = eng.perplexity(eng.tokenizer.encode(text.read_text()), 128)
    print(f"gemma3-270m PPL {ppl:.4f} +/- {err:.5f}; transformers {hf:.4f}; with llama.cpp's activation "
          f"rounding {emu.ppl:.4f} vs llama.cpp {ref['ppl']} ({(emu.ppl / ref['ppl'] - 1) * 100:+.2f}%)")
    assert abs(ppl / hf - 1) < 5e-4
    assert abs(emu.ppl / ref["ppl"] - 1) < 0.01
    assert abs(emu.ppl_err / ref["ppl_err"] - 1) < 0.05


def test_run_greedy_prints_llamacpp_continuation_and_timings(code_moe_tiny):
    ref = _llamacpp("greedy", "code-moe-tiny.gguf", prompt="import os")
    r = runner.invoke(app, ["run", "-m", str(code_moe_tiny), "-p", "import os", "-n", "16", "--temp", "0"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("import os" + ref["generated_text"])  # the prompt, as llama-cli echoes it
    quiet = runner.invoke(app, ["run", "-m", str(code_moe_tiny), "-p", "import os", "-n", "16", "--temp", "0",
                                "--no-display-prompt"])
    assert quiet.stdout.startswith(ref["generated_text"])
    assert re.search(r"prompt eval time = .* / +\d+ tokens .* tokens per second", r.output)
    assert re.search(r"eval time = .* / +15 runs .* tokens per second", r.output)  # 16th token: no pass


def test_run_json_and_seed_reproducible(code_moe_tiny, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("def parse_args(")
    args = ["run", "-m", str(code_moe_tiny), "-f", str(prompt), "-n", "12", "--temp", "1.0", "--json"]
    a = json.loads(runner.invoke(app, args + ["--seed", "5"]).stdout)
    b = json.loads(runner.invoke(app, args + ["--seed", "5"]).stdout)
    c = json.loads(runner.invoke(app, args + ["--seed", "6"]).stdout)
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]
    assert len(a["tokens"]) == 12 and a["stop"] == "length"
    assert a["tokens"] != c["tokens"]
    assert a["timings"]["predicted_n"] == 12 and a["timings"]["predicted_per_second"] > 0


def test_run_default_model_is_gemma3(gemma3_270m):
    r = runner.invoke(app, ["run", "-p", "One, two, three, four,", "-n", "6", "--temp", "0"])
    assert r.exit_code == 0, r.output
    assert "default model" in r.output
    assert "five" in r.stdout


def test_chat_reply_equals_one_shot_on_the_rendered_template(gemma3_270m):
    # gemma-3-270m is a base model: its replies are not answers, so the test checks the mechanics:
    # the chat renders gemma's turn format and its greedy reply is the one-shot reply to that text
    r = runner.invoke(app, ["run", "-m", str(gemma3_270m), "-n", "8", "--temp", "0"],
                      input="What is the capital of France?\nAnd of Italy?\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "chat template: gemma" in r.output
    rendered = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    one = runner.invoke(app, ["run", "-m", str(gemma3_270m), "-n", "8", "--temp", "0", "-p", rendered,
                              "--no-display-prompt"])
    assert one.exit_code == 0, one.output
    reply = one.stdout.strip()
    assert reply and reply in r.stdout
    assert r.stdout.count("> ") >= 3  # two turns answered, then the prompt that read /exit


def test_an_undecodable_chat_line_is_refused_and_the_chat_goes_on(code_moe_tiny):
    """A byte that is not UTF-8 on stdin, in a strict UTF-8 locale (Python reads stdin strictly
    there): one error line for that line, then the next line is answered and the run exits 0."""
    import os

    env = dict(os.environ, LC_ALL="C.UTF-8", PYTHONIOENCODING="utf-8")
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "run", "-m", str(code_moe_tiny), "-n", "2",
                        "--temp", "0", "-c", "128", "-t", "2"], input=b"ab\xffc\nhi\n/exit\n", capture_output=True,
                       env=env, timeout=300)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err
    assert "error: this line is not valid UTF-8 (byte b'\\xff' at character 2): not sent" in err
    assert "Traceback" not in err and err.count("eval time") >= 1  # "hi" was answered


def test_context_full_stops_generation_cleanly(code_moe_tiny):
    r = runner.invoke(app, ["run", "-m", str(code_moe_tiny), "-p", "import os", "-n", "50", "--temp", "0",
                            "-c", "12", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["stop"] == "context"
    # 12 positions: the prompt and 9 generated tokens are evaluated; the 10th is sampled from the
    # last position's logits and needs no position of its own
    assert out["prompt_tokens"] + len(out["tokens"]) == 13


@pytest.mark.parametrize("args,message,code", [
    (["-p", ""], "prompt is empty", 1),
    (["-p", "x " * 40, "-c", "16"], "context is 16", 1),
    (["-p", "x", "--top-p", "1.5"], "--top-p", 2),
    (["-p", "x", "-n", "-3"], "-n/--n-predict", 2),
    (["-p", "x", "-c", "-1"], "-c/--ctx-size", 2),
    (["-p", "x", "-f", "whatever.txt"], "not both", 1),
])
def test_run_bad_input_is_one_error_line(code_moe_tiny, args, message, code):
    r = runner.invoke(app, ["run", "-m", str(code_moe_tiny)] + args)
    assert r.exit_code == code, r.output  # 2: a range Click checked while parsing (tests/test_cli_flags.py)
    assert "error:" in r.output and message in r.output


def test_missing_model_and_unknown_arch_exit_1(tmp_path):
    r = runner.invoke(app, ["run", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"])
    assert r.exit_code == 1 and "no such file" in r.output
    import gguf

    w = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "run", "-m", str(tmp_path / "mamba.gguf"), "-p", "hi"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "unsupported architecture 'mamba'" in r.stderr


def test_perplexity_text_too_short(code_moe_tiny, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("import os\n")
    r = runner.invoke(app, ["perplexity", "-m", str(code_moe_tiny), "-f", str(f), "-c", "64"])
    assert r.exit_code == 1 and "needs at least 128" in r.output
    r = runner.invoke(app, ["perplexity", "-m", str(code_moe_tiny)])
    assert r.exit_code == 1 and "-f FILE" in r.output


def test_prompt_text_is_read_as_llamacpp_reads_it(tmp_path):
    from moecache.cli.common import process_escapes, read_text_arg

    # llama.cpp common.cpp string_process_escapes: \n \r \t \' \" \\ and \xHH; others stay
    assert process_escapes(r"a\nb\tc\\d\x41\q\'\"") == "a\nb\tc\\dA\\q'\""
    assert process_escapes("\\x4") == "\\x4" and process_escapes("end\\") == "end\\"
    f = tmp_path / "p.txt"
    f.write_text("line\\n1\n\n")
    assert read_text_arg(None, f, escape=True) == "line\n1\n"  # one trailing newline dropped
    assert read_text_arg(None, f, escape=False) == "line\\n1\n"


def test_perplexity_chunks_limit_and_special_text_not_parsed(code_moe_tiny, tmp_path):
    text = require_shared("heldout-b.py.txt")
    r = runner.invoke(app, ["perplexity", "-m", str(code_moe_tiny), "-f", str(text), "-c", "256", "--chunks", "2"])
    assert r.exit_code == 0, r.output
    assert "[2]" in r.output and "[3]" not in r.output
    # special-token text in a perplexity input is ordinary text (llama-perplexity tokenizes with
    # parse_special = false): the file below is 2 chunks only if <|endoftext|> is split into pieces
    f = tmp_path / "special.txt"
    f.write_text("<|endoftext|>" * 12)
    r = runner.invoke(app, ["perplexity", "-m", str(code_moe_tiny), "-f", str(f), "-c", "16"])
    assert r.exit_code == 0, r.output


def test_one_shot_notes_ignored_chat_flags_and_checks_template_names_first(code_moe_tiny):
    r = runner.invoke(app, ["run", "-m", str(code_moe_tiny), "-p", "x = 1", "-n", "2", "-sys", "hi"])
    assert r.exit_code == 0 and "apply to chat" in r.output
    r = runner.invoke(app, ["run", "-m", str(code_moe_tiny), "--chat-template", "nonsense"])
    assert r.exit_code == 1 and "unknown chat template 'nonsense'" in r.output
    assert "model:" not in r.output  # failed before loading the model


def test_ngl_without_a_usable_gpu_says_so_and_runs_on_the_cpu(code_moe_tiny, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *a, **k):  # CI has no CuPy; make it so on a GPU machine too
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'", name="cupy")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    monkeypatch.delitem(sys.modules, "moecache.backends.cupy_backend", raising=False)
    r = runner.invoke(app, ["run", "-m", str(code_moe_tiny), "-p", "import os", "-n", "4", "--temp", "0",
                            "-ngl", "99"])
    assert r.exit_code == 0, r.output
    assert r.output.count("CuPy is not installed") == 1 and "backend: cpu" in r.output
