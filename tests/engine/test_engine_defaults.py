"""What kvcore runs with no flags (kvcore.engine.defaults): the choice per file and machine, and its reasons."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import last_json, run_cli

import kvcore.engine.defaults as defaults
import kvcore.kernels.cpu_kernels as cpu_kernels
from kvcore import Engine, EngineConfig
from kvcore.engine.defaults import ModelFacts, choose_defaults, file_facts
from kvcore.errors import ConfigError

TINY = Path(__file__).parents[1] / "data" / "tiny-llama"
Q4_FILE = ModelFacts(native_int4=True, head_shape=(49152, 576))


@pytest.fixture
def kernels_build(monkeypatch):
    """A machine where kvcore's kernels build and int4a8 runs (whatever this one has)."""
    monkeypatch.setattr(defaults, "kernel_reasons", lambda: [])
    monkeypatch.setattr(defaults, "int4a8_reasons", lambda: [])
    import kvcore.backends.cpu_decode as cpu_decode

    monkeypatch.setattr(cpu_decode, "kernel_reasons", lambda: [])


def test_engine_config_leaves_precision_and_formats_to_kvcore():
    config = EngineConfig()
    assert (config.dtype, config.weights, config.lm_head, config.backend) == ("auto", "auto", "auto", None)
    with pytest.raises(ConfigError, match="unknown weights format 'int3'"):
        EngineConfig(weights="int3")  # still checked at once, before anything is decided


def test_a_q4_file_runs_its_blocks_on_the_fast_kernels(kernels_build):
    choice = choose_defaults(EngineConfig(), Q4_FILE)
    chosen = (choice.dtype, choice.weights, choice.lm_head, choice.backend)
    # float32 activations and the int8 head: as accurate as llama.cpp on the same file
    assert chosen == ("float32", "int4a8", "int8", "cpu_decode")
    assert len(choice.reasons) == 4 and "float32 activations" in choice.reasons[0]
    assert "--weights float is the exact reference" in choice.reasons[0]
    config = choice.apply(EngineConfig(max_num_seqs=3))
    assert (config.dtype, config.weights, config.lm_head, config.backend, config.max_num_seqs) == (
        "float32", "int4a8", "int8", "cpu_decode", 3)
    assert choice.describe().startswith("chose dtype float32, weights int4a8, lm_head int8, backend cpu_decode "
                                        "because dtype float32:")
    fastest = choose_defaults(EngineConfig(dtype="bfloat16", lm_head="int4"), Q4_FILE)  # the documented fast path
    assert (fastest.weights, fastest.backend) == ("int4a8", "cpu_decode")
    kquant = choose_defaults(EngineConfig(), ModelFacts(native_codes=True, head_shape=(262144, 640)))
    assert (kquant.dtype, kquant.weights, kquant.lm_head) == ("float32", "gguf", "int8")


def test_without_vnni_the_q4_blocks_run_on_torchs_int4_kernel(kernels_build, monkeypatch):
    monkeypatch.setattr(defaults, "int4a8_reasons", lambda: ["int4a8 needs a CPU with AVX512-VNNI"])
    choice = choose_defaults(EngineConfig(), Q4_FILE)
    assert (choice.dtype, choice.weights, choice.lm_head) == ("bfloat16", "int4", "int4")
    assert any("int4a8 cannot run: int4a8 needs a CPU with AVX512-VNNI" in r for r in choice.reasons)


def test_without_a_compiler_no_kvcore_kernel_is_chosen(monkeypatch):
    no_cxx = ["no g++ or clang++ on PATH"]
    monkeypatch.setattr(defaults, "kernel_reasons", lambda: no_cxx)
    monkeypatch.setattr(defaults, "int4a8_reasons", lambda: no_cxx)
    choice = choose_defaults(EngineConfig(), Q4_FILE)
    assert (choice.dtype, choice.weights, choice.lm_head, choice.backend) == ("bfloat16", "int4", "dense", None)
    assert "lm_head dense: no g++ or clang++ on PATH" in choice.reasons  # neither packed head can run
    assert any(r.startswith("backend left to the registry: ") for r in choice.reasons)


def test_float_checkpoints_stay_float32_and_a_given_dtype_decides_the_rest(kernels_build):
    float_file = choose_defaults(EngineConfig(), ModelFacts())
    assert (float_file.dtype, float_file.weights, float_file.lm_head, float_file.backend) == (
        "float32", "float", "dense", None)
    assert float_file.reasons == ("dtype float32, the exact reference: the file's weights are not all blocks kvcore "
                                  "runs as stored",)
    reference = choose_defaults(EngineConfig(dtype="float32"), Q4_FILE)  # one flag: the exact path
    assert (reference.dtype, reference.weights, reference.lm_head, reference.backend) == (
        "float32", "float", "dense", None)
    bf16 = choose_defaults(EngineConfig(dtype="bfloat16"), ModelFacts())  # a float file is never quantized unasked
    assert (bf16.weights, bf16.lm_head) == ("float", "dense")


def test_given_settings_are_kept(kernels_build):
    choice = choose_defaults(EngineConfig(backend="sdpa", weights="int4", lm_head="dense"), Q4_FILE)
    assert (choice.dtype, choice.weights, choice.lm_head) == ("bfloat16", "int4", "dense")
    assert choice.apply(EngineConfig(backend="sdpa")).backend == "sdpa"
    paged = choose_defaults(EngineConfig(kv_cache="paged"), Q4_FILE)  # cpu_decode cannot read a paged cache
    assert paged.backend is None and any("layout 'paged'" in r for r in paged.reasons)
    alibi = choose_defaults(EngineConfig(attention_variants=("alibi",)), Q4_FILE)  # cpu_decode has no code variants
    assert alibi.backend is None and any("decode: no variant 'alibi'" in r for r in alibi.reasons)
    odd_head = choose_defaults(EngineConfig(), ModelFacts(native_int4=True, head_shape=(300, 64)))
    assert odd_head.lm_head == "dense" and "lm_head dense: the packed heads' kernels cannot take a [300, 64] head" \
        in odd_head.reasons


def test_tensor_parallelism_gets_the_dense_weights_it_can_shard(kernels_build):
    split = choose_defaults(EngineConfig(tensor_parallel_size=2), Q4_FILE)
    assert (split.dtype, split.weights, split.lm_head, split.backend) == ("float32", "float", "dense", None)
    assert "tensor parallelism (tensor_parallel_size > 1) shards dense weights" in split.reasons[0]
    bf16 = choose_defaults(EngineConfig(tensor_parallel_size=2, dtype="bfloat16"), Q4_FILE)
    assert (bf16.weights, bf16.lm_head) == ("float", "dense")
    assert any(r.startswith("weights float: tensor parallelism") for r in bf16.reasons)
    given = choose_defaults(EngineConfig(tensor_parallel_size=2, weights="int4a8"), Q4_FILE)
    assert given.weights == "int4a8"  # kept as given: the sharding check then refuses it with its reason


def test_every_decided_setting_says_why(kernels_build, monkeypatch):
    reference = choose_defaults(EngineConfig(dtype="float32"), Q4_FILE)
    assert reference.reasons == ("weights float: dtype float32 is the exact reference, on dense weights",)
    assert "every setting was given" not in reference.describe()
    half = choose_defaults(EngineConfig(dtype="float16"), Q4_FILE)  # the Q4 blocks take float32 or bfloat16
    assert half.weights == "float" and len(half.reasons) == 1 and half.reasons[0].startswith(
        "weights float: the file's blocks cannot run as stored here: int4a8 weights need dtype float32 or bfloat16")
    kquant = ModelFacts(native_codes=True, head_shape=(49152, 576))
    monkeypatch.setattr(cpu_kernels, "int4a8_reasons", lambda fmt="int4a8": ["no AVX2 on this CPU"])
    stuck = choose_defaults(EngineConfig(dtype="bfloat16"), kquant)  # the blocks' kernels cannot run here
    assert stuck.weights == "float" and stuck.reasons == (
        "weights float: the file's blocks cannot run as stored here: no AVX2 on this CPU",)
    given = EngineConfig(dtype="float32", weights="float", lm_head="dense", backend="sdpa")
    assert choose_defaults(given, Q4_FILE).describe().endswith("because every setting was given")


def test_file_facts_read_the_gguf_header():
    from kvcore.loaders.resolve import smollm2_path

    smollm2 = file_facts(str(smollm2_path()))  # Q4_1 layers, Q8_0 embedding: the header alone says so
    assert smollm2.native_int4 and smollm2.head_shape == (49152, 576)
    assert file_facts("smollm2") == smollm2
    assert file_facts(str(TINY)) == ModelFacts()  # a Hugging Face directory: float
    assert file_facts("/no/such/file.gguf") == ModelFacts()  # the loader reports it


def test_an_engine_over_a_built_model_follows_its_dtype(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="naive"))
    assert engine.config.dtype == "float32" and engine.config.weights == "float" and engine.config.lm_head == "dense"
    assert engine.choice.reasons == ("dtype follows the model's float32 weights",)


def test_one_shot_generate_sizes_the_kv_cache_to_its_request():
    from kvcore.cli.generate import load_engine
    from kvcore.cli.parser import build_parser

    def loaded(*flags):
        args = build_parser().parse_args(["generate", "--model", str(TINY), "--backend", "naive", *flags, "hello"])
        return load_engine(args, lambda tok: tok.encode("hello")).engine

    engine = loaded("--max-new-tokens", "5")
    assert engine.max_model_len == len(engine.tokenizer.encode("hello")) + 5  # not the model's window
    assert engine.cache.spec.max_seq_len == engine.max_model_len
    assert loaded("--max-new-tokens", "5", "--max-model-len", "64").max_model_len == 64  # given: kept
    window = engine.model.config.max_position_embeddings
    assert loaded("--max-new-tokens", str(10 * window)).max_model_len == window  # the request then fails itself


def test_cli_reports_the_choice_and_peak_memory(capsys):
    rc, out, err = run_cli(capsys, "generate", "--model", str(TINY), "--backend", "naive", "--max-new-tokens", "2",
                           "--ignore-eos", "--json", "--verbose", "hello")
    assert rc == 0
    result = last_json(out)
    assert result["choice"] == {"dtype": "float32", "weights": "float", "lm_head": "dense", "backend": None,
                                "reasons": ["dtype float32, the exact reference: the file's weights are not all "
                                            "blocks kvcore runs as stored"]}
    assert err.count("kvcore: chose dtype float32, weights float, lm_head dense because dtype float32") == 1
    memory = result["memory"]
    assert memory["peak_rss_bytes"] >= memory["rss_before_load_bytes"] > 10 * 2**20


def test_peak_rss_is_this_programs_own_after_a_fork_and_exec():
    """A child started by a big parent (fork + exec, as subprocess does) reports its own peak, not the parent's
    (getrusage's maxrss keeps the parent's peak across the exec)."""
    import subprocess
    import sys

    import torch

    ballast = torch.ones(400 * 2**20, dtype=torch.uint8)  # 400 MiB resident in the parent
    code = "from kvcore.cli.generate import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert int(ballast.sum()) == 400 * 2**20 and 0 < child < 200 * 2**20
