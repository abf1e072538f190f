"""fastckpt's remote tier: checkpoints on object stores (S3, GCS,
any S3-compatible store) and shared filesystems, through fsspec.

Rooms (one concern each): :mod:`.store` (URL -> a checked store, the
clients), :mod:`._policy` (retries, bandwidth cap), :mod:`.transfer`
(parallel multipart upload and ranged download of one file, CRC-32),
:mod:`.manifest` (the step layout and its commit marker),
:mod:`.replicator` (background replication, retention, restore),
:mod:`.team` (a step uploaded by every rank of a job, each its part, rank 0
writing the manifest) and :mod:`.urlio` (``fastckpt.save``/``load`` of a
URL). Optional dependencies: ``pip install 'fastckpt-io[s3]'`` (s3fs) or
``'fastckpt-io[gcs]'`` (gcsfs).
"""

from ._policy import TransferOptions
from .manifest import delete_step, list_steps, read_manifest, write_manifest
from .replicator import LocalCheckpoint, Replicator, clean_stale, commit_step, restore_step, upload_step_files
from .store import Store, is_url, open_store
from .transfer import TransferStats, download, upload

__all__ = ["open_store", "is_url", "Store", "TransferOptions", "TransferStats", "upload", "download",
           "read_manifest", "write_manifest", "list_steps", "delete_step", "Replicator", "LocalCheckpoint", "upload_step_files",
           "commit_step", "restore_step", "clean_stale"]
