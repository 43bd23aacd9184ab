"""Hostile model files end in a typed kvcore error or correct behaviour: never a hang, never more than
1 GB, never an internal error, never garbage with exit 0.

The corpus (tests/hostile/make_corpus.py, ~90 cases) is built in a temporary directory and run in one
child process (tests/hostile/run_cases.py: address space capped at its imports + 1 GiB, 20 s alarm per
case); a child that stops answering is killed and restarted after the case it was on. A few cases also
go through the ``kvcore`` CLI, each in its own process under the same limits.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hostile"))

import make_corpus  # noqa: E402

RUNNER = Path(__file__).resolve().parents[1] / "hostile" / "run_cases.py"
CASES = make_corpus.all_cases()
CHILD_TIMEOUT_S = 300  # the whole corpus; a hung case costs its own 20 s alarm, not this
CLI_TIMEOUT_S = 60
CLI_MEMORY_LIMIT = 1 << 30  # peak resident memory of one `kvcore` run
# the module fixtures run the whole corpus and every CLI case: under `--dist loadgroup` (make test) one xdist
# worker runs every test here, so they run once, not once per worker
pytestmark = pytest.mark.xdist_group("test_hostile")


@pytest.fixture(scope="module")
def corpus() -> tuple[Path, dict[str, dict]]:
    """The corpus directory and every case's result from the child runner."""
    root = Path(tempfile.mkdtemp(prefix="kvcore-hostile-"))
    root.chmod(0o755)  # the permission case reads as an unprivileged user
    try:
        paths = make_corpus.write_corpus(root)
        assert len(paths) >= 40
        yield root, _run_all(root, list(CASES))
    finally:
        for where, dirs, files in os.walk(root):  # undo chmod 000 (top-down: before os.walk enters a dir)
            for name in dirs:
                os.chmod(os.path.join(where, name), 0o755)
            for name in files:
                os.chmod(os.path.join(where, name), 0o644)
        shutil.rmtree(root)


def _run_all(root: Path, names: list[str]) -> dict[str, dict]:
    results: dict[str, dict] = {}
    while pending := [n for n in names if n not in results]:
        proc = subprocess.Popen([sys.executable, str(RUNNER), str(root), *pending], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        timer = threading.Timer(CHILD_TIMEOUT_S, proc.kill)
        timer.start()
        current = None
        for line in proc.stdout:
            if line.startswith("START "):
                current = line[6:].strip()
            elif line.startswith("RESULT "):
                record = json.loads(line[7:])
                results[record["name"]] = record
                current = None
        stderr = proc.stderr.read()
        proc.wait()
        timer.cancel()
        if current is None and [n for n in names if n not in results]:
            raise AssertionError(f"the case runner died between cases (exit {proc.returncode}): {stderr[-2000:]}")
        if current is not None:  # the process died or hung inside a case: that case failed, go on after it
            results[current] = {"name": current, "outcome": f"process ended (exit {proc.returncode})",
                                "message": stderr[-2000:]}
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_case(corpus, name: str) -> None:
    root, results = corpus
    case, result = CASES[name], results[name]
    assert result["outcome"] in ("ok", "error"), f"{name}: {result}"
    if case.error is None:
        assert result["outcome"] == "ok", f"{name} must load and run: {result}"
        return
    assert result["outcome"] == "error", f"{name} loaded although it is malformed: {result}"
    assert case.error in result["kinds"], f"{name}: expected {case.error}, got {result['kinds']}: {result['message']}"
    message = result["message"]
    assert case.match in message, f"{name}: {message!r} does not say {case.match!r}"
    assert "\n" not in message, message
    if "ModelLoadError" in result["kinds"]:
        assert str(root / name) in message, f"{name}: the message does not name the file: {message}"
    assert result["seconds"] < 10, result


def test_a_lying_context_length_changes_nothing(corpus) -> None:
    """A window of 10^8 positions generates what the true window does (RoPE tables sized to requests)."""
    _, results = corpus
    for valid, huge in (("gguf_valid", "gguf_context_1e8"), ("hf_valid", "hf_max_position_1e8")):
        assert results[huge]["detail"]["token_ids"] == results[valid]["detail"]["token_ids"]


#: runs ``kvcore.cli.main`` and, at exit, writes the process's peak RSS (VmHWM, KiB) to a file: measured
#: inside the process, because the rusage of a forked child also counts the pages of the pytest parent it
#: was forked from
_PEAK_WRAPPER = """
import atexit, os, sys
from kvcore.cli import main

def _peak():
    with open("/proc/self/status") as status:
        hwm = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(os.environ["KVCORE_TEST_PEAK_FILE"], "w") as out:
        out.write(hwm)

atexit.register(_peak)
sys.exit(main(sys.argv[1:]))
"""


def _kvcore(*args: str, peak_file: Path, stdin: Path | None = None) -> tuple[int, str, str, int]:
    """``kvcore ARGS`` in a fresh process (reading ``stdin``, a path): exit code, stdout, stderr and peak resident
    memory in bytes."""
    def cap_address_space() -> None:  # a safety net only: the peak is what the test asserts on
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVCORE_TEST_PEAK_FILE": str(peak_file)}
    with open(stdin or os.devnull, "rb") as source:
        proc = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, *args], capture_output=True, text=True, env=env,
                              timeout=CLI_TIMEOUT_S, preexec_fn=cap_address_space, stdin=source)
    return proc.returncode, proc.stdout, proc.stderr, int(peak_file.read_text()) * 1024


#: corpus case, command, exit code (README's table), what stderr must say
CLI_CASES = [
    ("gguf_huge_array_length", "generate", 3, "tokenizer.ggml.tokens"),
    ("gguf_block_count_1e9", "generate", 3, "block_count"),
    ("hf_config_deep", "generate", 3, "nests JSON too deeply"),
    ("gguf_template_hang", "chat", 2, "did not finish"),
    ("gguf_valid", "generate", 0, ""),
]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, int]]:
    """Every CLI case's run, three processes at a time (each spends seconds importing torch)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(case: tuple[str, str, int, str]) -> tuple[int, str, str, int]:
        name, command = case[:2]
        where = tmp_path_factory.mktemp(name)
        path = CASES[name].build(where)
        return _kvcore(command, "--model", str(path), "--max-new-tokens", "4", "--json", "a th",
                       peak_file=where / "peak_kib")

    with ThreadPoolExecutor(3) as pool:
        return dict(zip((c[0] for c in CLI_CASES), pool.map(run, CLI_CASES)))


@pytest.mark.parametrize(("name", "command", "exit_code", "says"), CLI_CASES)
def test_hostile_files_through_the_cli(cli_runs, name: str, command: str, exit_code: int, says: str) -> None:
    code, out, err, peak = cli_runs[name]
    assert code == exit_code, (code, err)
    assert "internal error" not in err and "Traceback" not in err, err
    assert peak < CLI_MEMORY_LIMIT, f"peak RSS {peak >> 20} MiB"
    if exit_code:
        assert err.startswith("kvcore: error: ") and says in err and err.count("\n") == 1, err
    else:
        result = json.loads(out.strip().splitlines()[-1])
        assert len(result["token_ids"]) == 4 and all(0 <= t < make_corpus.VOCAB for t in result["token_ids"])


def test_validation_of_the_embedded_model_is_fast() -> None:
    """Walking SmolLM2's header (a 49k-token vocabulary and its merges) adds well under 0.3 s to a load."""
    import time

    from kvcore.loaders.gguf_validate import validate_gguf
    from kvcore.loaders.resolve import smollm2_path

    timings = []
    for _ in range(3):
        start = time.perf_counter()
        layout = validate_gguf(smollm2_path())
        timings.append(time.perf_counter() - start)
        assert len(layout.tensors) == 272
    assert min(timings) < 0.3, timings


@pytest.mark.parametrize("alignment", [32, 64])
def test_validator_places_tensors_where_the_gguf_reader_does(tmp_path: Path, alignment: int) -> None:
    """The validator's layout (data start, offsets, byte sizes of quantised types) is the reader's."""
    import gguf
    import numpy as np

    from kvcore.loaders.gguf_validate import validate_gguf

    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(alignment)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    rng = np.random.default_rng(0)
    for i, qtype in enumerate([gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                               gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1,
                               gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K]):
        values = rng.normal(size=(3, 256)).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            raw = values
        elif qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):  # no numpy quantiser
            raw = rng.integers(0, 255, size=(3, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        else:
            raw = gguf.quants.quantize(values, qtype)
        writer.add_tensor(f"t{i}", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    layout, reader = validate_gguf(path), gguf.GGUFReader(path)
    assert (layout.data_offset, layout.alignment) == (reader.data_offset, alignment)
    assert len(reader.fields) == layout.num_kv + 3  # the reader adds the header's three fields
    assert [(t.name, t.offset, t.nbytes, t.ggml_type) for t in layout.tensors] == [
        (t.name, int(t.data_offset), int(t.n_bytes), int(t.tensor_type)) for t in reader.tensors
    ]


@pytest.mark.parametrize(("options", "says"), [
    ({"max_n": 10**9}, "max_n must be in [1, 16], got 1000000000"),  # indexed 10^9 n-gram sizes per token
    ({"max_n": 17}, "max_n must be in [1, 16]"),
    ({"max_n": 1e9}, "max_n must be a positive integer, got 1000000000.0"),
    ({"min_n": 0}, "min_n must be a positive integer"),
    ({"max_n": 4, "min_n": 5}, "min_n (5) is larger than max_n (4)"),
    ({"misses": True}, "misses must be a positive integer"),
])
def test_ngram_options_out_of_range_are_config_errors(tmp_path: Path, options: dict, says: str) -> None:
    """A [proposers.ngram] table with a huge max_n hung its first request and grew memory by ~200 MB/s; each option
    out of range is a ConfigError naming it and its range, when the proposer is made."""
    from kvcore.engine.file_config import load_config
    from kvcore.errors import ConfigError
    from kvcore.plugins.registry import get_registry

    path = tmp_path / "kvcore.toml"
    values = "\n".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
    path.write_text(f'proposer = "ngram"\n\n[proposers.ngram]\n{values}\n')
    table = load_config(path).proposers["ngram"]
    with pytest.raises(ConfigError) as caught:
        get_registry().create_proposer("ngram", table)
    assert says in str(caught.value) and "'ngram'" in str(caught.value)
    assert get_registry().create_proposer("ngram", {"max_n": 16, "min_n": 16}).max_n == 16


@pytest.mark.parametrize(("flag", "source", "says"), [
    ("--json-schema", "/dev/zero", "--json-schema file '/dev/zero' is not a regular file"),  # read for ever, exit 70
    ("--grammar", "/dev/zero", "--grammar file '/dev/zero' is not a regular file"),
    ("--json-schema", "big", "is larger than 1048576 bytes"),
    ("--grammar", "binary", "is not UTF-8 text"),
    ("--json-schema", "folder", "cannot read --json-schema file"),
])
def test_schema_and_grammar_files_are_read_within_bounds(tmp_path: Path, flag: str, source: str, says: str) -> None:
    """--json-schema / --grammar read a regular file (or a pipe) of at most 1 MiB, no further: anything else is one
    line and exit code 2 (ConfigError), before the model loads."""
    model = CASES["gguf_valid"].build(tmp_path)
    paths = {"big": tmp_path / "big.json", "binary": tmp_path / "g.lark", "folder": tmp_path}
    paths["big"].write_text('{"type": "string", "description": "' + "x" * (1 << 20) + '"}')
    paths["binary"].write_bytes(b"start: \"a\"\xff\xfe\n")
    path = str(paths.get(source, source))
    code, _, err, peak = _kvcore("generate", "--model", str(model), flag, path, "a th", peak_file=tmp_path / "peak")
    assert code == 2, (code, err)
    assert err.startswith("kvcore: error: ") and says in err and err.count("\n") == 1, err
    assert peak < CLI_MEMORY_LIMIT, f"peak RSS {peak >> 20} MiB"


@pytest.mark.parametrize(("source", "says"), [
    ("/dev/zero", "prompt file '/dev/zero' is not a regular file"),  # read for ever, then an internal error
    ("big", f"is larger than {16 << 20} bytes"),
])
def test_prompt_file_is_read_within_bounds(tmp_path: Path, source: str, says: str) -> None:
    """--prompt-file reads a regular file (or a pipe) of at most 16 MiB, no further: else one line, exit code 2."""
    model = CASES["gguf_valid"].build(tmp_path)
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * ((16 << 20) + 1))
    path = str(big if source == "big" else source)
    code, _, err, peak = _kvcore("generate", "--model", str(model), "--prompt-file", path, peak_file=tmp_path / "peak")
    assert code == 2, (code, err)
    assert err.startswith("kvcore: error: ") and says in err and err.count("\n") == 1, err
    assert peak < CLI_MEMORY_LIMIT, f"peak RSS {peak >> 20} MiB"


@pytest.mark.parametrize(("command", "source"), [
    (("generate", "-"), "/dev/zero"),  # read for ever, then an internal error
    (("generate", "and the prompt"), "big"),  # piped text before the prompt
    (("chat",), "/dev/zero"),  # one line with no end
])
def test_standard_input_is_read_within_bounds(tmp_path: Path, command: tuple[str, ...], source: str) -> None:
    """A prompt read from standard input (``-``, piped before a prompt, chat turns) is bounded as --prompt-file is:
    at most 16 MiB, read no further; else one line, exit code 2."""
    model = CASES["gguf_valid"].build(tmp_path)
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * ((16 << 20) + 1))
    code, _, err, peak = _kvcore(command[0], "--model", str(model), *command[1:], peak_file=tmp_path / "peak",
                                 stdin=big if source == "big" else Path(source))
    assert code == 2, (code, err)
    assert err == f"kvcore: error: standard input is larger than {16 << 20} bytes\n", err
    assert peak < CLI_MEMORY_LIMIT, f"peak RSS {peak >> 20} MiB"
