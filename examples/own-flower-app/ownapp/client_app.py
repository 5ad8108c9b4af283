"""This app's ClientApp: its own data loaders, and pflalign's client function for the method's
messages (train, evaluate, and the discovery query that starts a run)."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients import answer
from ownapp.task import Net, load_data

app = ClientApp()

#: loaders kept per partition, so that each is read once per process
_LOADERS: dict[int, tuple] = {}


def _reply(msg: Message, context: Context) -> Message:
    partition_id = int(context.node_config["partition-id"])
    if partition_id not in _LOADERS:
        _LOADERS[partition_id] = load_data(partition_id)
    trainloader, testloader = _LOADERS[partition_id]
    return answer(msg, context, model=Net, trainloader=trainloader, testloader=testloader)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _reply(msg, context)
