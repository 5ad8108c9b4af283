"""Instruction data (``dataset = jsonl:PATH_OR_DIR``) on a tiny randomly initialized Llama with
LoRA: a small Dolly-like file written here; each record one sample whose labels are its
response's tokens only; the loss, the token accuracy and the test counts over those tokens; the
natural clients (a client field, one file per client, Dolly's categories); the engines'
agreement; and bad files, one sentence each."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import three_engines
from tiny_lm import write_tiny_lm

from pflalign.data.datasets import IGNORE_INDEX, TokenIds
from pflalign.data.federated import federated_dataset
from pflalign.data.instructions import instruction_sample, prompt_of, read_records
from pflalign.models.language import tokenizer_of
from pflalign.run.config import build_settings
from pflalign.run.driver import simulate
from pflalign.settings.options import ConfigError
from pflalign.training.client import ClientRuntime
from pflalign.training.loops import evaluate
from pflalign.training.objectives import cross_entropy

pytest.importorskip("peft", reason="the [text] extra (transformers, peft) is not installed")

CATEGORIES = ("open_qa", "classification", "summarization", "creative_writing")
WORDS = ("river", "stone", "lamp", "garden", "violin", "harbor", "cloud", "meadow")


def dolly(seed: int = 0) -> list[dict]:
    """Dolly-like records of four categories (9 to 12 each), one of them with contexts."""
    rng = np.random.default_rng(seed)
    records = []
    for k, category in enumerate(CATEGORIES):
        for _ in range(9 + k):
            a, b = rng.choice(WORDS, 2, replace=False)
            n = int(rng.integers(2, 9))
            context = ""
            if k == 0:
                instruction, response = (f"How many letters are in the word {a}?",
                                         f"The word {a} has {len(a)} letters.")
            elif k == 1:
                instruction, response = f"Is {n} even or odd?", "even" if n % 2 == 0 else "odd"
            elif k == 2:
                context = f"The {a} stood beside the {b} for {n} long years, and nobody moved it."
                instruction = "Summarize the passage in one sentence."
                response = f"A {a} stayed by a {b} for {n} years."
            else:
                instruction, response = (f"Write a short line about a {a} and a {b}.",
                                         f"The {a} sings to the {b} at dusk.")
            records.append({"instruction": instruction, "context": context,
                            "response": response, "category": category})
    return records


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    texts = [prompt_of(r["instruction"], r["context"]) + r["response"] for r in dolly()]
    return "hf:" + str(write_tiny_lm(tmp_path_factory.mktemp("tiny-lm"), texts))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("dolly") / "dolly.jsonl", dolly())


def _run(tiny, records, **changes):
    return {"dataset": f"jsonl:{records}", "model": tiny, "partition": "natural",
            "num-clients": 3, "num-unseen-clients": 1, "sequence-length": 48, "rounds": 1,
            "batch-size": 4, "local-steps": 2, "lr": 0.5, "eval-every": 1, "seed": 1,
            "lora-rank": 4, "fraction-train": 1.0, "min-samples-per-client": 5, **changes}


def test_engines_agree_on_instructions_scored_on_their_responses(tiny, records, tmp_path):
    """The sequential and batched engines give the same metrics (a language model on Flower:
    test_language's three engines); every client is a category, and its test counts its
    records' response tokens."""
    results = three_engines(_run(tiny, records, methods="pflalign"), tmp_path, 40,
                            flower=False)
    settings = build_settings(_run(tiny, records))
    federation = federated_dataset(settings)
    names = federation.partition.names
    assert sorted(names) == sorted(CATEGORIES)
    for client in results["methods"]["pflalign"]["clients"]:
        test = federation.dataset.labels[federation.pool[federation.partition.test[client["id"]]]]
        assert client["num-test"] == federation.sizes(client["id"])[1] == int(
            (test != IGNORE_INDEX).sum())
    last = results["methods"]["pflalign"]["rounds"][-1]
    assert math.isclose(last["personal-ppl"], math.exp(last["personal-loss"]))
    # vmap's per-target mask: the loop backend's numbers within float32 rounding
    vmap = simulate(build_settings({**_run(tiny, records, methods="pflalign"),
                                    "engine": "batched", "batched-backend": "vmap",
                                    "out-dir": str(tmp_path / "v")}))
    for key in ("train-loss", "personal-loss"):
        assert math.isclose(vmap["methods"]["pflalign"]["rounds"][-1][key], last[key],
                            rel_tol=1e-5)


def test_a_record_is_its_prompt_and_response_and_only_the_response_is_a_label(tiny, records):
    dataset = federated_dataset(build_settings(_run(tiny, records))).dataset
    tokenizer = tokenizer_of(tiny)
    eos = tokenizer.eos_token_id
    assert dataset.images.dtype == np.int32 and dataset.labels.dtype == np.int64
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    record = dolly()[9]  # classification, no context: it fits
    p = encode(f"### Instruction:\n{record['instruction']}\n\n### Response:\n")
    r = encode(record["response"]) + [eos]
    pad = [tokenizer.pad_token_id] * (48 + 1 - len(p) - len(r))
    assert len(pad) > 1
    assert dataset.images[9].tolist() == (p + r + pad)[:48]
    assert dataset.labels[9].tolist() == ([IGNORE_INDEX] * (len(p) - 1) + r
                                          + [IGNORE_INDEX] * len(pad))
    record = dolly()[19]  # summarization, with a context: too long for the window
    p = encode(f"### Instruction:\n{record['instruction']}\n\n### Context:\n"
               f"{record['context']}\n\n### Response:\n")
    r = encode(record["response"]) + [eos]
    kept = 24  # the prompt's last half window, and the response's start after it
    assert len(p) > kept and len(r) > 48 + 1 - kept
    assert dataset.images[19].tolist() == (p[-kept:] + r)[:48]
    assert dataset.labels[19].tolist() == [IGNORE_INDEX] * (kept - 1) + r[:48 + 1 - kept]
    # a record longer than the window keeps its response's start: the prompt's end, then the
    # response cut at the window's end; the prompt keeps at least half the window
    inputs, labels = instruction_sample(list(range(1, 11)), list(range(20, 26)), 8, 0)
    assert inputs.tolist() == [7, 8, 9, 10, 20, 21, 22, 23]
    assert labels.tolist() == [IGNORE_INDEX] * 3 + [20, 21, 22, 23, 24]
    inputs, labels = instruction_sample([1, 2, 3], list(range(20, 40)), 8, 0)
    assert labels.tolist() == [IGNORE_INDEX] * 2 + list(range(20, 26))


def test_the_loss_and_the_token_accuracy_are_the_response_tokens_only(tiny, records):
    settings = build_settings(_run(tiny, records))
    client = ClientRuntime(settings, 2, torch.device("cpu"))
    model = client.new_model()
    model.eval()
    x, y = client.data.train_x[:5], client.data.train_y[:5]
    with torch.no_grad():
        logits = model(x.long())
    scored = y != IGNORE_INDEX
    assert 0 < int(scored.sum()) < scored.numel()
    # by hand: -log p(target) at each response place, and the argmax there
    log_p = torch.log_softmax(logits.double(), dim=1)
    b, t = scored.nonzero(as_tuple=True)
    losses = -log_p[b, y[b, t], t]
    assert math.isclose(float(cross_entropy(logits, y, None)), float(losses.mean()),
                        rel_tol=1e-6)  # one client's training loss
    assert math.isclose(float(cross_entropy(logits, y, scored.float())), float(losses.mean()),
                        rel_tol=1e-6)  # a cohort's under vmap: a weight per target
    stats = evaluate(model, x, y, TokenIds(), batch_size=2)
    assert stats.count == len(losses)
    assert stats.correct == int((logits.argmax(dim=1)[b, t] == y[b, t]).sum())
    assert math.isclose(stats.loss_sum, float(losses.sum()), rel_tol=1e-6)
    # what the model says at the prompt's and the padding's places counts for nothing
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    noisy = logits + 10 * noise * (~scored).unsqueeze(1)
    assert torch.equal(cross_entropy(noisy, y, None), cross_entropy(logits, y, None))
    assert not torch.equal(F.cross_entropy(noisy, y.clamp_min(0)),
                           F.cross_entropy(logits, y.clamp_min(0)))
    assert client.data.num_test == int((client.data.test_y != IGNORE_INDEX).sum())


def test_clients_from_a_client_field_files_or_categories(tiny, tmp_path):
    alpaca = [{"instruction": f"Say {w}.", "input": "" if i % 2 else "Quietly.", "output": w,
               "client": ["north", "south"][i % 2]} for i, w in enumerate(WORDS)]
    found = read_records(f"jsonl:{write_jsonl(tmp_path / 'alpaca.jsonl', alpaca)}")
    assert found.by == "client" and found.names == ("north", "south")
    assert found.groups.tolist() == [0, 1] * 4
    assert found.contexts[0] == "Quietly." and found.responses[2] == WORDS[2]
    folder = tmp_path / "folder"
    folder.mkdir()
    records = dolly()
    write_jsonl(folder / "b.jsonl", records[:5])
    write_jsonl(folder / "a.jsonl", records[5:12])
    (folder / "notes.txt").write_text("not records")
    found = read_records(f"jsonl:{folder}")
    assert found.by == "file" and found.names == ("a", "b")
    assert found.groups.tolist() == [0] * 7 + [1] * 5  # the files by name: a.jsonl first
    found = read_records(f"jsonl:{write_jsonl(tmp_path / 'dolly.jsonl', records)}")
    assert found.by == "category" and found.names == tuple(sorted(CATEGORIES))
    plain = [{k: v for k, v in r.items() if k != "category"} for r in records]
    path = write_jsonl(tmp_path / "plain.jsonl", plain)
    assert read_records(f"jsonl:{path}").groups is None
    with pytest.raises(ConfigError, match="partition = 'natural' needs a dataset with its own"):
        build_settings({"dataset": f"jsonl:{path}", "model": tiny,
                        "partition": "natural"})


@pytest.mark.parametrize("lines,message", [
    (['{"instruction": "a", "response": "b"}', '{"instruction": "c", "response": }'],
     r"bad.jsonl, line 2, is not valid JSON \(Expecting value at column 34\); write one JSON "
     "object per line"),
    (['{"instruction": "a", "response": "b"}', '', '{"instruction": "c"}'],
     "bad.jsonl, line 3, has no response; every record needs instruction and response"),
    (['{"context": "x", "output": "y"}'], "line 1, has no instruction"),
    (['{"instruction": "a", "response": 3}'], "line 1, has a response that is a JSON int"),
    (['["instruction", "response"]'], "line 1, is a JSON list, not an object"),
    (['{"instruction": "a", "response": "b", "client": "x"}', '{"instruction": "a", '
      '"response": "b"}'], "line 2, has no client while other records have one"),
])
def test_bad_records_are_one_sentence_naming_the_line(tiny, tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        build_settings({"dataset": f"jsonl:{path}", "model": tiny,
                        "partition": "iid"})


def test_bad_files_are_one_sentence_and_write_nothing(tiny, records, tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"instruction": "caf\xe9", "response": "b"}\n')
    with pytest.raises(ConfigError, match=r"latin.jsonl, line 1, is not UTF-8 text \(invalid "
                       r"continuation byte at byte 20 of the line\); convert the file"):
        build_settings(_run(tiny, latin))
    folder = tmp_path / "clients"
    folder.mkdir()
    write_jsonl(folder / "full.jsonl", dolly()[:6])
    (folder / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="empty.jsonl has no records; every file"):
        build_settings(_run(tiny, folder))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("not records")
    with pytest.raises(ConfigError, match="the folder has no .jsonl files"):
        build_settings(_run(tiny, tmp_path / "texts"))
    with pytest.raises(ConfigError, match="whose instructions a language model's own tokenizer "
                       "reads: set model = hf:<model>"):
        build_settings(_run(tiny, records, model="char-lstm"))
    with pytest.raises(ConfigError, match="dataset = 'jsonl:' needs a path"):
        build_settings({"dataset": "jsonl:", "partition": "iid"})
    # a path that does not exist yet passes the config (a shipped config names data the user
    # fetches) and is one sentence when the data is read, before anything is written
    settings = build_settings(_run(tiny, tmp_path / "dolly-15k.jsonl",
                                   **{"out-dir": str(tmp_path / "out")}))
    with pytest.raises(ConfigError, match="dolly-15k.jsonl': the file or folder does not exist"):
        simulate(settings)
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_nodes_partition_file_keeps_the_masked_targets(tiny, records, tmp_path):
    """Deployment: a SuperNode's file holds its records' tokens and labels, and counts its test
    as the pooled data does (its response tokens)."""
    from pflalign.data.node import export_partitions, load_partition, pooled_node_data

    settings = build_settings(_run(tiny, records))
    (path,) = export_partitions(settings, tmp_path, clients=[1])
    meta, node = load_partition(path)
    pooled = pooled_node_data(settings, 1)
    for split in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(node.data, split), getattr(pooled.data, split))
    assert node.data.masked_targets and meta["masked-targets"]
    assert node.data.num_test == pooled.data.num_test == meta["num-test"] < node.data.test_y.numel()
