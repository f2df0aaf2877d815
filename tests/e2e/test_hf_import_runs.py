"""Importing a Hugging Face folder without a Kiln config, as a user does it: transformers writes a tiny
model of each supported model_type (llama, mixtral, qwen3, qwen3_moe, deepseek_v3; odd shapes, with a
tokenizer), `convert_hf.py from-hf --hf F --out D` reads the
shape from F/config.json, `generate.py --checkpoint D` gives transformers' own greedy tokens, and
`train.py --config D/config.toml` trains from D. What config.json fields are refused is
tests/unit/test_hf_import.py."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components.config.loading import load_config
from components.data.tokenizer import Tokenizer
from tests.helpers.runs import REPO, check_ok, dump_args, fails_with, run_train, train_rows

transformers = pytest.importorskip("transformers")  # a test-only dependency
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TOKENIZER = REPO / "assets" / "tokenizer" / "tokenizer.json"
PROMPT = "ROMEO:"
NEW_TOKENS = 12
# Odd shapes: GQA with one kv head, an intermediate_size Meta's sizing cannot give, tied embeddings
# and Llama 3.1 RoPE scaling; weights large enough (initializer_range) that greedy choices are clear.
CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=1024,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256})),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512)),
    # head_dim 24 ≠ 64 / 4, one kv head, tied embeddings (as Qwen3's small sizes).
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, max_position_embeddings=512)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=20,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=36, norm_topk_prob=True,
        max_position_embeddings=512)),
    # Full-rank queries (q_lora_rank unset, as V2-Lite), qk 12 + 6 ≠ v 10, a dense block then an MoE
    # block with 8 experts in 4 groups (top 2 groups), a shared expert, YaRN.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        hidden_size=64, intermediate_size=100, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24,
        qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def hf_folder(kind: str, folder: Path) -> Path:
    """A folder as transformers' save_pretrained writes it: the model, then its tokenizer."""
    config_cls, model_cls, shape = CONFIGS[kind]
    ours = Tokenizer(TOKENIZER)
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=4096, initializer_range=0.2, bos_token_id=ours.bos_id,
                                 eos_token_id=ours.eos_id, **shape))
    model.save_pretrained(folder)
    vocab = ours._tok
    transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), bos_token=vocab.id_to_token(ours.bos_id),
        eos_token=vocab.id_to_token(ours.eos_id)).save_pretrained(folder)
    return folder


def convert(*args: str):
    return run_train(["from-hf", *args], script="scripts/convert_hf.py")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """kind → (HF folder, imported Kiln folder), made once per kind."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(kind: str) -> tuple[Path, Path]:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"import_{kind}")
            folder = hf_folder(kind, root / "hf")
            check_ok(convert("--hf", str(folder), "--out", str(root / "kiln")))
            made[kind] = folder, root / "kiln"
        return made[kind]

    return make


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_generate_gives_transformers_greedy_tokens(imported, kind):
    folder, out = imported(kind)
    for name in (".metadata", "config.json", "tokenizer.json", "tokenizer_config.json", "kiln_model.py",
                 "config.toml"):
        assert (out / name).is_file(), name
    proc = run_train(["--checkpoint", str(out), "--prompt", PROMPT, "--temperature", "0",
                      "--max-new-tokens", str(NEW_TOKENS)], script="scripts/generate.py")
    check_ok(proc)
    tokenizer = Tokenizer(out)
    prompt = tokenizer.encode(PROMPT, bos=True)
    hf = CONFIGS[kind][1].from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id)[0, len(prompt):]
    want = tokenizer.decode(tokens.tolist())
    assert proc.stdout.startswith(PROMPT)
    got = proc.stdout[len(PROMPT):].removesuffix("\n")
    # The streamer holds back a last token that ends inside a multi-byte character.
    assert got == want or (want.endswith("\ufffd") and want.startswith(got)), (got, want)
    assert len(got) > 0


@pytest.mark.parametrize("kind", ["llama", "mixtral", "deepseek_v3"])
def test_trains_from_the_imported_folder(imported, kind, tmp_path, data_cache):
    _, out = imported(kind)
    proc = run_train(["--config", str(out / "config.toml"), "--training.steps", "2",
                      "--training.seq_len", "64", "--training.local_batch_size", "2",
                      "--metrics.log_freq", "1", *dump_args(tmp_path, data_cache)])
    check_ok(proc)
    assert f"started from {out} (model)" in proc.stdout
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)


def test_refused_config_is_one_line_and_writes_nothing(imported, tmp_path):
    folder, _ = imported("llama")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    proc = convert("--hf", str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"convert_hf: error: {bad / 'config.json'} sets attention_bias = true, which Kiln's llama3 does not "
        f"implement (no biases in the attention projections)"]
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    proc = convert("--hf", str(bad), "--out", str(tmp_path / "out"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "model_type 'gpt_neox'" in lines[0], lines
    assert "llama (llama3)" in lines[0] and "mixtral (moe)" in lines[0]
    proc = convert("--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"convert_hf: error: Hugging Face folder not found: {tmp_path / 'nope'}"]
    proc = convert("--hf", str(folder), "--out", str(tmp_path / "out"), "--model.flavor", "tiny")
    assert proc.returncode == 2 and "--model.flavor: overrides need --config" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_folder_without_tokenizer_says_so(imported, tmp_path):
    folder, _ = imported("mixtral")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(folder / name, bare / name)
    proc = convert("--hf", str(bare), "--out", str(tmp_path / "out"))
    check_ok(proc)
    assert "has no tokenizer.json: set model.tokenizer_path" in proc.stdout
    toml = load_config(["--config", str(tmp_path / "out" / "config.toml")])
    assert toml.model.tokenizer_path == "assets/tokenizer/tokenizer.json"  # the default: not set


def test_damaged_import_is_one_error(imported, tmp_path):
    _, out = imported("llama")
    broken = tmp_path / "kiln"
    shutil.copytree(out, broken)
    # config.toml names the original folder: point it at the copy.
    (broken / "config.toml").write_text((broken / "config.toml").read_text().replace(str(out), str(broken)))
    (broken / "config.json").write_text("{ not json")
    args = ["--checkpoint", str(broken), "--prompt", PROMPT, "--max-new-tokens", "2"]
    fails_with(run_train(args, script="scripts/generate.py"), f"cannot parse {broken / 'config.json'}")
    fails_with(run_train(["--config", str(broken / "config.toml"), "--training.steps", "1",
                          *dump_args(tmp_path / "run")]), f"cannot parse {broken / 'config.json'}")
    (broken / "config.json").unlink()
    fails_with(run_train(args, script="scripts/generate.py"), f"no config.json in {broken}")
    (broken / "kiln_model.py").unlink()
    fails_with(run_train(args, script="scripts/generate.py"), "kiln_model.py", "no such file")


def test_exports_back_bit_identical(imported, tmp_path):
    """to-hf --config D/config.toml gives the imported tensors back, the odd intermediate_size and the
    RoPE scaling included."""
    folder, out = imported("llama")
    check_ok(run_train(["to-hf", "--config", str(out / "config.toml"), "--checkpoint", str(out),
                        "--out", str(tmp_path / "hf")], script="scripts/convert_hf.py"))
    before, after = load_file(folder / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["intermediate_size"] == 100 and config["rope_scaling"]["rope_type"] == "llama3"
