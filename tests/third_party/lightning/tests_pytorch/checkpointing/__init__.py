# Copied unchanged from https://github.com/Lightning-AI/pytorch-lightning, file
# tests/tests_pytorch/checkpointing/__init__.py at tag 2.6.5 (commit be98784a1a03581b7051a355ae1084fd352d7cea; the stored mirror has no 2.6.6
# tag, 2.6.5 is the closest release to the installed lightning 2.6.6). Licensed under the Apache
# License, Version 2.0 (https://www.apache.org/licenses/LICENSE-2.0); the licence text is in
# tests/third_party/lightning/LICENSE. Local modifications: none besides this header.
# tests/third_party/lightning/conftest.py runs the tests with fastckpt's CheckpointIO swapped in.
