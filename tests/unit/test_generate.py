"""Generation on one process: the KV cache changes nothing but speed, and sampling obeys its knobs.
The script streaming seeded text from a real run's checkpoint is tests/e2e/test_generate_runs.py."""

import torch

from components.generation import generate, kv_cache_layers, sample_next
from components.runtime.custom_import import import_custom
from tests.helpers.runs import REPO, tiny_llama


def tiny_model() -> torch.nn.Module:
    model = tiny_llama()
    with torch.no_grad():
        model.output.weight.mul_(30)  # sharper distributions: a wrong cache shows in the choices
    return model.eval()


def test_kv_cache_gives_the_full_recompute_tokens():
    """Greedy tokens with the cache equal greedy tokens from re-running the whole sequence."""
    model = tiny_model()
    prompt = [5, 17, 300, 42, 7]
    notes: list[str] = []
    cached = generate(model, prompt, 20, temperature=0, note=notes.append)
    assert len(notes) == 1 and "KV cache" in notes[0]  # the path taken, said once
    assert len(kv_cache_layers(model)) == len(model.layers)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert cached == seq[len(prompt):]
    assert model.rope_positions is None  # the model is left as it was
    assert model.layers["0"].attention.core_attention.__name__ == "causal_attention"


def test_a_model_without_the_cache_hooks_is_generated_by_full_recompute():
    """GPT-2 (examples/, learned positions, no Kiln attention hooks): greedy tokens equal re-running
    the whole sequence, and one line says why it is slower."""
    from models import get_model_spec

    import_custom(str(REPO / "examples" / "gpt2_model.py"))
    spec = get_model_spec("gpt2")
    torch.manual_seed(0)
    model = spec.model_cls(spec.flavors["tiny"])
    model.init_weights()
    with torch.no_grad():
        model.output.weight.mul_(30)
    model.eval()
    assert kv_cache_layers(model) == []
    notes: list[str] = []
    prompt = [5, 17, 300, 42, 7]
    got = generate(model, prompt, 20, temperature=0, note=notes.append)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):] and len(set(got)) > 1
    assert len(notes) == 1 and "recomputes the whole sequence" in notes[0] and "rope_positions" in notes[0]


def test_sampling_knobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    assert sample_next(logits, 0.0, 0, 1.0, gen) == 1
    assert {sample_next(logits, 1.0, 1, 1.0, gen) for _ in range(20)} == {1}  # top-1 = greedy
    assert {sample_next(logits, 1.0, 0, 0.01, gen) for _ in range(20)} == {1}  # tiny top-p = greedy
    assert {sample_next(logits, 5.0, 2, 1.0, gen) for _ in range(200)} == {1, 2}  # only the best two
    drawn = {sample_next(logits, 5.0, 0, 1.0, gen) for _ in range(400)}
    assert drawn == {0, 1, 2, 3}


def test_same_seed_same_text():
    model = tiny_model()
    runs = [generate(model, [1, 2, 3], 30, temperature=1.0, top_k=50, top_p=0.95, seed=s) for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
