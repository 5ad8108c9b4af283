"""Write each client's own partition file, for a deployment where every node holds only its data.

    python -m pflalign.run.export_partitions --config FILE --set num-clients=3 --out DIR
    python -m pflalign.run.export_partitions --set num-clients=3 --out DIR --clients 2
    python -m pflalign.run.export_partitions --set num-clients=3 --write-config run.toml

The config is resolved as ``simulate.py`` resolves it (defaults, ``--config FILE``, each
``--set key=value``). ``DIR/client-<i>.npz`` holds client ``i``'s train and test images and labels
exactly as a simulation gives them, and a metadata entry (dataset, classes, input shape,
normalisation, client id, unseen or not, and the fingerprint of the data-defining keys). A
SuperNode started with ``--node-config "partition-id=<i> data-path='DIR/client-<i>.npz' ..."``
reads only that file and refuses one made for another data config (see docs/deployment.md).
``--write-config FILE`` writes the resolved config as a TOML run config for
``flwr run ... --run-config FILE``, so the run uses exactly the config the files were made for.
``--bind-keys DIR`` (with ``--set node-keys=FILE``) binds each client ``i`` to the SuperNode
public key ``DIR/node-<i>.pub``, in FILE, which the ServerApp reads (:mod:`pflalign.wire.binding`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pflalign.data.node import data_fingerprint, export_partitions
from pflalign.run.config import ConfigError, format_settings, resolve
from pflalign.wire.binding import write_bindings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pflalign.run.export_partitions",
        description="Write one partition file per client (DIR/client-<i>.npz) for a deployment.")
    parser.add_argument("--config", metavar="FILE", help="TOML run config (default: the "
                        "built-in defaults, as `flwr run` uses them).")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="Override one config key; repeatable.")
    parser.add_argument("--out", metavar="DIR", help="Directory for client-<i>.npz.")
    parser.add_argument("--clients", metavar="LIST",
                        help="Comma-separated client ids to export (default: every client).")
    parser.add_argument("--write-config", metavar="FILE",
                        help="Also write the resolved config as a TOML run config to FILE.")
    parser.add_argument("--bind-keys", metavar="DIR",
                        help="Bind each exported client i to the SuperNode public key "
                             "DIR/node-<i>.pub, in the file the config's node-keys names "
                             "(pflalign.wire.binding).")
    args = parser.parse_args(argv)
    if not args.out and not args.write_config and not args.bind_keys:
        parser.error("give --out DIR (partition files), --write-config FILE and/or "
                     "--bind-keys DIR")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = resolve(args.config, args.overrides)
        if args.write_config:
            path = Path(args.write_config)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(format_settings(settings))
            tmp.replace(path)
            print(f"wrote {path}")
        if args.out:
            clients = None
            if args.clients:
                try:
                    clients = [int(c) for c in args.clients.split(",") if c.strip()]
                except ValueError:
                    raise ConfigError(f"--clients {args.clients!r} is not a comma-separated "
                                      "list of client ids.") from None
            paths = export_partitions(settings, args.out, clients)
            print(f"wrote {len(paths)} partition file(s) to {args.out} "
                  f"(data fingerprint {data_fingerprint(settings)})")
        if args.bind_keys:
            if not settings.run.node_keys:
                raise ConfigError("--bind-keys needs node-keys = FILE in the config (where the "
                                  "ServerApp reads the binding), e.g. --set "
                                  "node-keys=/abs/path/node-keys.json.")
            clients = ([int(c) for c in args.clients.split(",") if c.strip()] if args.clients
                       else list(range(settings.num_nodes)))
            path = write_bindings(settings.run.node_keys, args.bind_keys, clients)
            print(f"bound {len(clients)} partition-id(s) to the keys in {args.bind_keys}: {path}")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
