"""A researcher's own tables, splits and float images, written fresh for each test.

A CSV (and the same table as Parquet) with string labels, named clients and a split column; an
npz of float images with a split array; an image folder with each client's own train and test
folders: each runs on the sequential and batched engines bit for bit (the CSV also on the Flower
engine, whose nodes read every source through the same pooled loader), keeps the data's
own split for every client, and names its classes and clients. Bad tables get
one sentence and write nothing.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from harness import three_engines
from PIL import Image

from pflalign.data.federated import federated_dataset
from pflalign.run.cli import main
from pflalign.run.config import build_settings
from pflalign.settings.options import ConfigError

RUN = {"rounds": 2, "local-steps": 2, "methods": "fedavg,fedrep", "fraction-train": 1.0}
CLIENTS = ("alice", "bob", "carol")


def mail_table(n: int = 40, seed: int = 0) -> pd.DataFrame:
    """Three named clients, six features, string labels, a given split (the first 30 rows of
    each client train)."""
    rng = np.random.default_rng(seed)
    rows = []
    for c, name in enumerate(CLIENTS):
        x = rng.normal(c - 1.0, 1.0, (n, 6))
        score = x @ rng.normal(0, 1, 6)
        labels = np.where(score > 0.5, "spam", np.where(score < -0.5, "ham", "unsure"))
        for i in range(n):
            rows.append({"user": name, **{f"f{j}": x[i, j] for j in range(6)},
                         "label": labels[i], "split": "train" if i < 30 else "test"})
    return pd.DataFrame(rows)


def test_a_csv_with_string_labels_clients_and_a_split_runs_bit_for_bit_on_every_engine(
        tmp_path):
    table = mail_table()
    table.to_csv(tmp_path / "mail.csv", index=False)
    table.to_parquet(tmp_path / "mail.parquet")
    values = {**RUN, "dataset": f"csv:{tmp_path / 'mail.csv'}", "num-clients": 3}
    results = three_engines(values, tmp_path, compared_at_least=40)
    partition = results["partition"]
    assert partition["class-names"] == ["ham", "spam", "unsure"]
    assert sorted(c["name"] for c in partition["clients"]) == sorted(CLIENTS)
    # the data's own split: 30 train and 10 test rows for every client
    assert {(c["num-train"], c["num-test"]) for c in partition["clients"]} == {(30, 10)}
    # the labels: each client's test labels, counted in the file, as the run counted them
    for client in partition["clients"]:
        rows = table[(table.user == client["name"]) & (table.split == "test")]
        assert client["test-labels"] == [int((rows.label == k).sum())
                                         for k in partition["class-names"]]
    assert results["config"]["partition"] == "natural" and results["config"]["model"] == "mlp"
    # the report's per-client table names the clients
    from pflalign.outputs.report import write_report

    report = write_report(tmp_path / "report", results)[0].read_text()
    acc = {label: {c["name"]: c["personal-acc"] for c in entry["clients"]}
           for label, entry in results["methods"].items()}
    for name in CLIENTS:
        assert (f"| {name} | 10 | {100 * acc['fedavg'][name]:.2f} | "
                f"{100 * acc['fedrep'][name]:.2f} |") in report
    # the same table as Parquet is the same data
    parquet = build_settings({**values, "dataset": f"parquet:{tmp_path / 'mail.parquet'}"})
    assert federated_dataset(parquet).fingerprint() == partition["fingerprint"]


def test_float_images_with_a_split_array_are_used_as_given(tmp_path):
    rng = np.random.default_rng(1)
    n = 240
    y = rng.integers(0, 3, n)
    x = rng.normal(0, 1, (n, 1, 28, 28)).astype(np.float32)
    for k in range(3):
        x[y == k, 0, 9 * k:9 * (k + 1)] += 2.0
    split = np.where(np.arange(n) % 4 == 0, "test", "train")
    np.savez(tmp_path / "float.npz", x=x, y=y, client=np.array(CLIENTS)[np.arange(n) % 3],
             split=split)
    values = {**RUN, "dataset": f"npz:{tmp_path / 'float.npz'}", "num-clients": 3}
    results = three_engines(values, tmp_path, compared_at_least=40, flower=False)
    assert {(c["num-train"], c["num-test"]) for c in results["partition"]["clients"]} == {
        (60, 20)}
    data = federated_dataset(build_settings(values))
    client = data.client_data(0)
    assert client.test_x.dtype == np.float32 or str(client.test_x.dtype) == "torch.float32"
    # used as given: what the model receives is the array itself
    assert (client.normalize(client.test_x) == client.test_x).all()


def test_client_folders_with_their_own_train_and_test_folders(tmp_path):
    rng = np.random.default_rng(2)
    for client in CLIENTS:
        for split, count in (("train", 9), ("test", 4)):
            for cls in ("circle", "square"):
                folder = tmp_path / "shapes" / client / split / cls
                folder.mkdir(parents=True)
                for i in range(count):
                    pixels = (rng.random((28, 28)) * 120).astype(np.uint8)
                    if cls == "square":
                        pixels[8:20, 8:20] = 255
                    Image.fromarray(pixels).save(folder / f"{i}.png")
    values = {**RUN, "dataset": f"imagefolder:{tmp_path / 'shapes'}", "num-clients": 3,
              "cache-dir": str(tmp_path / "cache")}
    results = three_engines(values, tmp_path, compared_at_least=40, flower=False)
    partition = results["partition"]
    assert {(c["num-train"], c["num-test"]) for c in partition["clients"]} == {(18, 8)}
    assert partition["class-names"] == ["circle", "square"]
    assert {tuple(c["test-labels"]) for c in partition["clients"]} == {(4, 4)}


@pytest.mark.parametrize(("change", "expected"), [
    (lambda t: t.assign(split=t.split.where(t.index != 7, "valid")),
     "the split of row 7 is 'valid'; each row's split must be train or test."),
    (lambda t: t.drop(columns=["label"]),
     "has no label column (none of label, labels, y, target, class; its columns are user, f0"),
    (lambda t: t.assign(f2=t.f2.where(t.index != 5, np.nan)),
     "row 5 has a missing or infinite feature value; fill or drop it."),
    (lambda t: t.assign(f3="x"), "column 'f3' is not numeric"),
    (lambda t: t.assign(split="train"),
     "has no test samples in the data's split; give every client both"),
])
def test_a_bad_table_gets_one_sentence_and_writes_nothing(tmp_path, capsys, change, expected):
    change(mail_table()).to_csv(tmp_path / "bad.csv", index=False)
    out = tmp_path / "out"
    code = main(["--set", f"dataset=csv:{tmp_path / 'bad.csv'}", "--set", "num-clients=3",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err, err
    assert err.strip().count("\n") == 0 and not out.exists()


def test_a_split_with_a_partition_that_pools_is_refused(tmp_path):
    mail_table().to_csv(tmp_path / "mail.csv", index=False)
    settings = build_settings({"dataset": f"csv:{tmp_path / 'mail.csv'}", "num-clients": 3,
                               "partition": "iid"})
    with pytest.raises(ConfigError, match="set partition = natural"):
        federated_dataset(settings)


def test_a_table_without_a_client_column_is_split_like_any_dataset(tmp_path):
    table = mail_table().drop(columns=["user", "split"])
    table.to_csv(tmp_path / "pooled.csv", index=False)
    settings = build_settings({"dataset": f"csv:{tmp_path / 'pooled.csv'}", "num-clients": 4,
                               "partition": "iid"})
    data = federated_dataset(settings)
    assert data.partition.num_clients == 4 and data.dataset.class_names == ("ham", "spam",
                                                                            "unsure")
    assert json.dumps(data.summary())  # a summary results.json can hold
