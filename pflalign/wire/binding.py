"""Each deployed client's ``partition-id`` bound to a SuperNode key, proved at discovery.

A SuperNode declares its ``partition-id`` in its own node config, so without more a registered
node could claim another client's id. With SuperNode authentication every node holds an ECDSA key
pair whose public half is registered with the SuperLink; this module binds each client id to one
such public key and has the node prove, at discovery, that it holds the private half:

- when the partitions are exported (``python -m pflalign.run.export_partitions --bind-keys DIR``),
  :func:`write_bindings` writes ``node-keys`` (a JSON file: client id -> the OpenSSH public key
  ``DIR/node-<i>.pub``), which the ServerApp reads;
- the ServerApp's discovery message carries a fresh random challenge (:func:`new_challenge`);
- a node whose node config names its private key (``auth-key``, the file it gives
  ``flower-supernode --auth-supernode-private-key``) signs the challenge with its id
  (:func:`sign`, ECDSA with SHA-384);
- the server accepts a node's claim to an id only when that signature verifies against the key
  bound to the id (:func:`proof_problem`). A node without a valid proof is not used and is named;
  the honest holder of the id is not displaced by it.

The challenge changes with every discovery, so an earlier proof cannot be replayed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pflalign.settings.options import ConfigError

#: what a node signs: this prefix, the challenge and its partition-id
_PURPOSE = b"pflalign discovery proof v1\0"
#: the records of a discovery message and reply that carry the challenge and the proof
CHALLENGE, PROOF = "challenge", "proof"


def write_bindings(path: str | Path, keys_dir: str | Path, clients: list[int]) -> Path:
    """Bind each of ``clients`` to the public key ``keys_dir/node-<i>.pub``; write the bindings
    to ``path`` (atomically) and return it. A missing or unreadable key is a ConfigError."""
    bindings = {}
    for cid in clients:
        key_path = Path(keys_dir) / f"node-{cid}.pub"
        try:
            text = key_path.read_text().strip()
            key = serialization.load_ssh_public_key(text.encode())
        except (OSError, ValueError, UnsupportedAlgorithm) as err:
            raise ConfigError(f"Cannot bind client {cid} to a key: '{key_path}' is not an "
                              f"OpenSSH public key ({type(err).__name__}); make one with "
                              "`ssh-keygen -t ecdsa -b 384`.") from err
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ConfigError(f"'{key_path}' is not an ECDSA key; SuperNode authentication "
                              "uses `ssh-keygen -t ecdsa -b 384` keys.")
        bindings[str(cid)] = text
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"version": 1, "bindings": bindings}, indent=1))
    tmp.replace(path)
    return path


def read_bindings(path: str | Path) -> dict[int, ec.EllipticCurvePublicKey]:
    """The client id -> public key bindings in ``path`` (:func:`write_bindings`)."""
    try:
        data = json.loads(Path(path).read_text())
        return {int(cid): serialization.load_ssh_public_key(text.encode())
                for cid, text in data["bindings"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError,
            UnsupportedAlgorithm) as err:
        raise ConfigError(f"node-keys = '{path}' cannot be read as a key binding file "
                          f"({type(err).__name__}: {str(err)[:120]}); write it with "
                          "`python -m pflalign.run.export_partitions --bind-keys DIR`.") from err


def new_challenge() -> bytes:
    """A fresh random challenge for one discovery."""
    return os.urandom(32)


def _message(challenge: bytes, client_id: int) -> bytes:
    return _PURPOSE + challenge + str(int(client_id)).encode()


def sign(private_key_path: str | Path, challenge: bytes, client_id: int) -> bytes:
    """A node's proof that it holds the private key at ``private_key_path`` (OpenSSH format,
    unencrypted, as ``ssh-keygen -N ""`` writes it), for ``client_id`` and this challenge."""
    try:
        key = serialization.load_ssh_private_key(Path(private_key_path).read_bytes(),
                                                 password=None)
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise ValueError(f"This SuperNode's auth-key '{private_key_path}' cannot be read as an "
                         f"unencrypted OpenSSH private key ({type(err).__name__}).") from err
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"This SuperNode's auth-key '{private_key_path}' is not an ECDSA key.")
    return key.sign(_message(challenge, client_id), ec.ECDSA(hashes.SHA384()))


def proof_problem(bindings: Mapping[int, ec.EllipticCurvePublicKey], client_id: int,
                  challenge: bytes, signature: bytes | None) -> str | None:
    """Why a node's claim to ``client_id`` is not proved (None when it is)."""
    key = bindings.get(client_id)
    if key is None:
        return f"no key is bound to partition-id {client_id} in node-keys"
    if not signature:
        return (f"it gave no proof that it holds the key bound to partition-id {client_id} "
                "(its node config needs auth-key = its SuperNode private key)")
    try:
        key.verify(bytes(signature), _message(challenge, client_id), ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return (f"its proof does not verify against the key bound to partition-id {client_id} "
                "(it holds another key)")
    return None
