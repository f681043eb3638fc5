"""Record counts of TFRecord files, so that a resumed run finds its place without reading the data.

``record_counts.txt`` sits beside the shards (the converter and the data tools write it) and, for shards written
by other tools, in model_dir, where a resumed run caches the counts it had to compute. One line per file,
tab-separated: the file name (beside the shards) or its full path (in model_dir's cache), its whole records, and
its size in bytes; lines starting with '#' are comments::

    # imagenet_tpu record counts: file, records, bytes
    train-00000-of-01024	1251	143224567

Local files are counted at every resume (cheap, see below), so a wrong entry cannot move a resume; it is
reported. For a remote file an entry is used only while the file still has the size it records and the count is
possible for that size; otherwise the file is counted again and the mismatch is reported. The file a resumed
stream starts in is always counted again.

In a tensorflow_datasets folder, dataset_info.json's ``shardLengths`` serve as the counts file beside the shards:
it records no byte sizes, so its counts are checked only against what the file's size allows.

Counting walks the TFRecord framing (an 8-byte length, a 4-byte length CRC, the data and a 4-byte data CRC). On a
local disk it seeks to each record's length field and reads those 8 bytes only: about 12 MB for ImageNet's 140 GB.
A remote file (gs://...) is read once from start to end in large blocks instead, without seeking (a seek past
tf.io.gfile's 512 KiB stream buffer starts a new read), and many files are counted at once (count_files): a
remote read waits mostly on the network, so counting 1,024 shards one after another is bound by latency. A
file that ends mid-record counts its whole records, as the training
stream reads them.
"""

import concurrent.futures
import os
import struct
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from imagenet_tpu.data import tfrecord
from imagenet_tpu.files import is_local, matching

FILE_NAME = 'record_counts.txt'
HEADER = '# imagenet_tpu record counts: file, records, bytes\n'
FRAME_BYTES = 16       # length (8), length CRC (4), data CRC (4) around each record's data
BLOCK_BYTES = 16 * 2 ** 20   # what a remote file is read in, from start to end
REMOTE_WORKERS = 32    # files counted at once when any is remote (each waits mostly on the network)
LOCAL_WORKERS = 4      # and when all are local (a local disk gains little from more)


def path_in(folder: str) -> str:
    return os.path.join(folder, FILE_NAME)


def count_file(path: str) -> int:
    """Whole records in one TFRecord file, from its length fields."""
    return scan_file(path)[0]


def scan_file(path: str, block_bytes: int = BLOCK_BYTES) -> Tuple[int, bool]:
    """(whole records, whether the file ends where its last whole record does) of one TFRecord file, from its
    length fields. A file cut mid-record gives False. A local file is read 8 bytes per record (seeking past the
    data); a remote one from start to end in reads of ``block_bytes``, without seeking."""
    size = tf.io.gfile.stat(path).length
    if is_local(path):
        with open(path, 'rb', buffering=0) as f:
            return _scan_seeking(f, size)
    with tf.io.gfile.GFile(path, 'rb') as f:
        return _scan_blocks(f.read, size, block_bytes)


def _scan_seeking(f, size: int) -> Tuple[int, bool]:
    """The framing walked by seeking to each length field of the file ``f`` (``size`` bytes) and reading it."""
    count, offset = 0, 0
    while offset + FRAME_BYTES <= size:
        f.seek(offset)
        header = f.read(8)
        if len(header) < 8:
            break
        length, = struct.unpack('<Q', header)
        if offset + FRAME_BYTES + length > size:
            break               # cut mid-record: the records before the cut are whole
        offset += FRAME_BYTES + length
        count += 1
    return count, offset == size


def _scan_blocks(read: Callable[[int], bytes], size: int, block_bytes: int) -> Tuple[int, bool]:
    """The framing walked through a file of ``size`` bytes read in order by ``read(n)`` (at most n bytes, b''
    at its end), n at most ``block_bytes``. One block is held at a time: a length field split by a block
    boundary is carried into the next block, and blocks inside a record's data are read and dropped."""
    count, offset = 0, 0        # whole records so far; where the next record starts
    block, start = b'', 0       # the block last read; where in the file it starts
    header = b''                # the part of a length field that the previous block ended in
    while offset + FRAME_BYTES <= size:
        at = offset + len(header) - start      # where in the block the (rest of the) length field starts
        if at >= len(block):                   # it is further on: read on
            start += len(block)
            block = b''                        # dropped before the next one is read
            block = read(min(block_bytes, size - start))   # no more than the file holds (allocated whole)
            if not block:
                break
            continue
        if not header and at + 8 <= len(block):
            length, = struct.unpack_from('<Q', block, at)
        else:
            header += block[at:at + 8 - len(header)]
            if len(header) < 8:
                continue                       # the block ends inside the length field
            length, = struct.unpack('<Q', header)
            header = b''
        if offset + FRAME_BYTES + length > size:
            break               # cut mid-record: the records before the cut are whole
        offset += FRAME_BYTES + length
        count += 1
    return count, offset == size


def count_files(paths: List[str], workers: Optional[int] = None) -> List[int]:
    """count_file of each of ``paths``, in their order, counted ``workers`` at a time (by default
    REMOTE_WORKERS when any path is remote, else LOCAL_WORKERS)."""
    if workers is None:
        workers = LOCAL_WORKERS if all(is_local(path) for path in paths) else REMOTE_WORKERS
    workers = max(1, min(workers, len(paths)))
    if workers == 1:
        return [count_file(path) for path in paths]
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix='record_counts')
    try:
        futures = [pool.submit(count_file, path) for path in paths]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)   # after an error, the files not yet begun are not counted


def read(path: str) -> Optional[Dict[str, Tuple[int, int]]]:
    """{file name as written: (records, bytes)} of a counts file; None if it does not exist. A malformed file
    raises ValueError naming the line."""
    if not tf.io.gfile.exists(path):
        return None
    entries = {}
    with tf.io.gfile.GFile(path, 'r') as f:
        for number, line in enumerate(f, start=1):
            if not line.strip() or line.startswith('#'):
                continue
            fields = line.rstrip('\n').split('\t')
            try:
                name, records, size = fields
                entries[name] = (int(records), int(size))
            except ValueError:
                raise ValueError(f'{path} line {number}: expected "file<TAB>records<TAB>bytes", '
                                 f'got {line.strip()!r}') from None
    return entries


def write(path: str, entries: Dict[str, Tuple[int, int]]) -> None:
    """Writes ``entries`` ({file name: (records, bytes)}) to the counts file ``path`` atomically."""
    lines = [HEADER] + [f'{name}\t{records}\t{size}\n' for name, (records, size) in sorted(entries.items())]
    temporary = f'{path}.tmp-{os.getpid()}'
    with tf.io.gfile.GFile(temporary, 'w') as f:
        f.write(''.join(lines))
    tf.io.gfile.rename(temporary, path, overwrite=True)


def _load(path: Optional[str], log: Callable[[str], None]) -> Dict[str, Tuple[int, int]]:
    if not path:
        return {}
    try:
        return read(path) or {}
    except ValueError as error:
        log(f'warning: {error}; counting the records again instead')
        return {}


def tfds_entries(data_dir: str) -> Dict[str, Tuple[int, Optional[int]]]:
    """{file name: (records, None)} from a tensorflow_datasets folder's dataset_info.json (empty elsewhere)."""
    layout = tfrecord.layout_of(data_dir)
    return {name: (count, None) for split in (layout.shard_lengths or {}) for name, count in
            layout.shard_names(split).items()}


def possible(count: int, size: int) -> bool:
    """Whether a file of ``size`` bytes can hold ``count`` whole records (each at least FRAME_BYTES)."""
    return 0 <= count and count * FRAME_BYTES <= size and (count > 0 or size < 2 * FRAME_BYTES)


def lookup(paths: List[str], sizes: List[int], data_dir: str, cache_dir: Optional[str] = None,
           log: Callable[[str], None] = print) -> List[int]:
    """Record count of each of ``paths`` (whose current byte sizes are ``sizes``), as a resume needs them.

    Local files are always counted (from their length fields: cheap), so a wrong counts file cannot move a
    resume; a count of the counts files that differs is reported. A remote file's count comes from data_dir's
    counts file, else from cache_dir's, else it is counted and added to cache_dir's (when given); an entry whose
    size is not the file's is reported and not used, and one impossible for the file's size (negative, zero for a
    file that holds a record, more records than 16-byte frames fit) is reported and the file counted instead.
    A tensorflow_datasets folder's shardLengths stand beside the shards' counts file, without sizes."""
    cache_path = path_in(cache_dir) if cache_dir else None
    cache = _load(cache_path, log)
    # data_dir's files name its shards; the cache names each file by its full path.
    sources = ((FILE_NAME, _load(path_in(data_dir), log), os.path.basename),
               ('dataset_info.json (shardLengths)', tfds_entries(data_dir), os.path.basename),
               (FILE_NAME, cache, lambda path: path))
    counts, to_count, recorded = [], [], {}
    for index, (path, size) in enumerate(zip(paths, sizes)):
        count = None
        for source, entries, key in sources:
            if key(path) in entries:
                recorded_count, recorded_size = entries[key(path)]
                if recorded_size is not None and recorded_size != size:
                    log(f'warning: {source} gives {path} {recorded_size} bytes but it has {size}: '
                        'counting its records again')
                elif not possible(recorded_count, size):
                    log(f'warning: {source} gives {path} {recorded_count} records, impossible for its {size} '
                        'bytes: counting its records again')
                elif is_local(path):
                    recorded[index] = (recorded_count, source)
                else:
                    count = recorded_count
                break
        if count is None:
            to_count.append(index)
        counts.append(count)
    counted = {}
    for index, count in zip(to_count, count_files([paths[index] for index in to_count])):
        counts[index] = count
        if index in recorded and recorded[index][0] != count:
            recorded_count, source = recorded[index]
            log(f'warning: {source} gives {paths[index]} {recorded_count} records but it holds {count}: '
                f'using {count} (delete or rewrite the wrong {source})')
        if not is_local(paths[index]):
            counted[paths[index]] = (count, sizes[index])
    if counted and cache_path:
        try:
            tf.io.gfile.makedirs(cache_dir)
            write(cache_path, {**cache, **counted})
        except (OSError, tf.errors.OpError) as error:   # a cache that cannot be written is only slower
            log(f'warning: cannot write {cache_path} ({type(error).__name__}); counts not cached')
    return counts


def write_beside(data_dir: str, counts: Optional[Dict[str, int]] = None) -> str:
    """Writes data_dir's counts file for every TFRecord shard in it (names 'split-NNNNN-of-NNNNN'):
    ``counts`` ({path: records}) for those it gives, an unchanged entry of the existing file, else counted."""
    paths = matching(os.path.join(data_dir, '*-*-of-*'))
    paths = [path for path in paths if not path.endswith(('.incomplete', '.txt'))]
    existing = _load(path_in(data_dir), print)
    entries, to_count = {}, []
    for path in paths:
        name, size = os.path.basename(path), tf.io.gfile.stat(path).length
        if counts and path in counts:
            entries[name] = (counts[path], size)
        elif name in existing and existing[name][1] == size:
            entries[name] = existing[name]
        else:
            to_count.append((path, size))
    for (path, size), count in zip(to_count, count_files([path for path, _ in to_count])):
        entries[os.path.basename(path)] = (count, size)
    write(path_in(data_dir), entries)
    return path_in(data_dir)
