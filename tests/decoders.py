"""Running exported decoders (onnxruntime-genai folders with a KV cache) step by step, and the check that they
give transformers' greedy tokens: the committed references (``reference.npz`` of models/fixtures/kv and
models/fixtures/shipped), and the exports the tests make once per run (``conftest.exported``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

TOLERANCE = 1e-4  # max |logits - transformers'| at every step (fp32)


def genai_config(folder: Path) -> dict:
    return json.loads((folder / "genai_config.json").read_text())


def greedy(session: ort.InferenceSession, config: dict, prompt_ids: np.ndarray, steps: int):
    """``steps`` greedy tokens from ``session``: the prompt with an empty cache (each past's heads and head size
    as the decoder declares them), then one token a step with the presents fed back as the pasts. Returns the
    tokens and each step's last-position logits."""
    decoder = config["model"]["decoder"]
    names = decoder["inputs"]
    past = {value.name: np.zeros((prompt_ids.shape[0], value.shape[1], 0, value.shape[3]), np.float32)
            for value in session.get_inputs() if value.name.startswith("past_key_values.")}
    outputs = [output.name for output in session.get_outputs()]
    presents = {name.replace("past_key_values.", "present."): name for name in past}
    tokens, logits, step_ids, seen = [], [], prompt_ids, 0
    for _ in range(steps):
        length = step_ids.shape[1]
        results = dict(zip(outputs, session.run(None, {
            names["input_ids"]: step_ids,
            names["attention_mask"]: np.ones((step_ids.shape[0], seen + length), np.int64),
            names["position_ids"]: np.arange(seen, seen + length, dtype=np.int64)[None].repeat(step_ids.shape[0], 0),
            **past}), strict=True))
        last = results[decoder["outputs"]["logits"]][:, -1]
        logits.append(last[0])
        tokens.append(int(last[0].argmax()))
        past = {presents[name]: value for name, value in results.items() if name in presents}
        seen += length
        step_ids = np.array([[tokens[-1]]], np.int64)
    return tokens, np.stack(logits)


def assert_generates_reference(session: ort.InferenceSession, folder: Path, reference: Path,
                               tolerance: float = TOLERANCE) -> np.ndarray:
    """The decoder of the folder ``folder`` (``session`` on it) gives the tokens of ``reference`` (a reference.npz)
    with every step's logits within ``tolerance``; returns the logits."""
    expected = np.load(reference)
    tokens, logits = greedy(session, genai_config(folder), expected["prompt_ids"], len(expected["tokens"]))
    assert tokens == expected["tokens"].tolist()
    error = np.abs(logits - expected["logits"]).max(axis=1)
    assert error.max() <= tolerance, f"max |logits - transformers'| per step: {error}"
    return logits


def genai_tokens(folder: Path, prompt_ids: np.ndarray, steps: int) -> list[int]:
    """onnxruntime-genai's greedy tokens from the folder ``folder`` after ``prompt_ids`` [1, T]: at most ``steps``
    (fewer when it stops at an end token)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt_ids.shape[1] + steps, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt_ids)
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens
