"""Keys that own their jobs: named keys from a keys file, each seeing only its own jobs (404 for others'), an admin
key seeing all; records carry the key's name, never the key; a bad keys file is refused at start in one line."""

import os
import re

import pytest

from h3_spark.errors import InputError
from h3_spark.serve.auth import Client, read_keys_file

ALICE, BOB, ROOT = "alice-token-0123456789", "bob-token-0123456789ab", "root-token-0123456789ab"


def _keys(tmp_path, text, mode=0o600):
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_a_keys_file_names_its_clients(tmp_path):
    keys = read_keys_file(_keys(tmp_path, f"# clients\nalice {ALICE}\nbob {BOB}  # the second\n\nroot {ROOT} admin\n"))
    assert keys == {ALICE: Client("alice"), BOB: Client("bob"), ROOT: Client("root", admin=True)}


@pytest.mark.parametrize("text, mode, message", [
    (f"alice {ALICE}\n", 0o644, "is open to other users (mode 644): chmod 600 it"),
    (f"alice {ALICE}\n", 0o660, "is open to other users (mode 660): chmod 600 it"),
    (f"alice\n", 0o600, "line 1: expected `NAME TOKEN [admin]`"),
    (f"alice {ALICE} root\n", 0o600, "line 1: expected `NAME TOKEN [admin]`"),
    (f"al/ice {ALICE}\n", 0o600, "line 1: expected `NAME TOKEN [admin]`"),
    ("alice short\n", 0o600, "line 1: the token of alice is 5 characters; use at least 16"),
    (f"alice {ALICE}\nalice {BOB}\n", 0o600, "line 2: the name alice is given twice"),
    (f"alice {ALICE}\nbob {ALICE}\n", 0o600, "line 2: a token is given twice"),
    ("# nothing\n", 0o600, "holds no key"),
])
def test_bad_keys_files_are_refused(tmp_path, text, mode, message):
    with pytest.raises(InputError, match=re.escape(message)):
        read_keys_file(_keys(tmp_path, text, mode))


def test_a_missing_keys_file_is_refused(tmp_path):
    with pytest.raises(InputError, match="--keys-file .*nowhere: no such file"):
        read_keys_file(tmp_path / "nowhere")
