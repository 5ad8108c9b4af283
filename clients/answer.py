"""A method's client side for your own ClientApp: :func:`answer`, with your model and data loaders.

A ServerApp of yours over a strategy of :mod:`strategies` (``strategies.PFLAlign(...)``), or the
project's own ServerApp, sends each client the method's train and evaluate messages, and a
discovery query when the run starts. A ClientApp of yours answers every one of them with
:func:`answer`, giving it this node's own data loaders::

    app = ClientApp()

    @app.train()
    def train(msg, context):
        trainloader, testloader = load_data(context.node_config["partition-id"])
        return answer(msg, context, model=Net, trainloader=trainloader, testloader=testloader)

    # the same for @app.evaluate() and @app.query() (discovery); @app.query("state") too when
    # the server writes checkpoints

The run has ``dataset = clients`` (:mod:`pflalign.data.clients`): the server holds no data, and
builds the model from ``model``, ``input-shape`` and ``num-classes``. ``model`` in the strategy's
config names your model's factory (``model = "py:yourpackage.task:Net"``, called as
``Net(input_shape, num_classes)``), and the ``model`` given here must be that same factory: both
sides build it seeded by the run's seed, so they start from the same weights, and the method's
rules (a personal head, a control variate) see the layers they expect.

The loaders are read once each (a loader object that lives on is read once per process) into a
float32 input tensor and an int64 label tensor, in their dataset's order (a shuffling DataLoader
is read through a sequential one): the method trains on them with its own seeded batches
(``batch-size``, ``local-epochs``), as on every engine, so a run is reproducible whatever order the
loader would shuffle into. A batch is ``(inputs, labels)``, or a dict whose input and label entries
``batch_keys`` names (default: its one floating and one integer tensor).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path

from flwr.app import Context, Message, MessageType
from torch import nn

from clients.app import _discovery, _reply, client_id_of, settings_of
from pflalign.data.clients import CLIENTS, parse_input_shape
from pflalign.data.loaders import node_data_from_loaders
from pflalign.data.node import NodeData
from pflalign.models import user
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import Settings
from pflalign.wire.protocol import CONFIG, EVALUATE, QUERY, STATE, TRAIN

#: the method's action for each Flower message type this function answers
_ACTIONS = {MessageType.TRAIN: TRAIN, MessageType.EVALUATE: EVALUATE}


def _where(factory: object) -> tuple[str | None, str | None]:
    """A factory's qualified name and source file (how two imports of one factory match)."""
    try:
        source = str(Path(inspect.getfile(factory)).resolve())  # type: ignore[arg-type]
    except (TypeError, OSError):
        source = None
    return getattr(factory, "__qualname__", None), source


def check_model(settings: Settings, model: Callable[..., nn.Module] | None) -> None:
    """``model`` (a ClientApp's own factory) is the one the run's ``model`` names, in one
    sentence if not."""
    if model is None:
        return
    name = settings.run.model
    mine = f"{getattr(model, '__module__', '?')}:{getattr(model, '__qualname__', model)}"
    if not user.is_user_model(name):
        raise ConfigError(f"This ClientApp passes its own model ({mine}), and the run's model is "
                          f"{name!r}: set model = 'py:{mine}' in the strategy's config, or pass "
                          "no model.")
    theirs = user.factory(name)
    if theirs is not model and _where(theirs) != _where(model):
        raise ConfigError(f"The run's model is {name!r}, and this ClientApp passes {mine}: the "
                          "server and the clients must build the same model.")


def answer(msg: Message, context: Context, *, trainloader: Iterable, testloader: Iterable,
           model: Callable[..., nn.Module] | None = None,
           batch_keys: tuple[str, str] | None = None) -> Message:
    """The reply of this node's client to ``msg`` (a train, evaluate, discovery, annealing or
    state message of a method's strategy), computed by the method's client rule on this node's
    own ``trainloader`` and ``testloader``; see the module docstring. The client's method state
    lives in ``context.state`` between messages, as in the project's ClientApp."""
    settings = settings_of(msg)
    if settings.run.dataset != CLIENTS:
        raise ConfigError(f"clients.answer serves a run whose clients hold the data (dataset = "
                          f"'clients'), and this run has dataset = {settings.run.dataset!r}, "
                          "whose partition the server holds: set dataset = 'clients' in the "
                          "strategy's config.")
    check_model(settings, model)

    def node_of(settings: Settings) -> NodeData:
        run = settings.run
        return node_data_from_loaders(
            client_id_of(context), trainloader, testloader, num_classes=run.num_classes,
            input_shape=parse_input_shape(run.input_shape),
            num_clients=run.num_clients + run.num_unseen_clients,
            num_train_clients=run.num_clients, batch_keys=batch_keys)

    kind, _, sub = msg.metadata.message_type.partition(".")
    if kind == MessageType.QUERY:
        if sub == STATE:
            return _reply(msg, context, STATE)
        if CONFIG in msg.content.config_records:
            return _reply(msg, context, QUERY, node_of)
        return _discovery(msg, context, node_of)
    if kind not in _ACTIONS:
        raise ValueError(f"clients.answer does not answer {msg.metadata.message_type!r} "
                         "messages.")
    return _reply(msg, context, _ACTIONS[kind], node_of)

