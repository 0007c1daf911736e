// Package checkpoint saves and loads dos's checkpoints: per rank and step,
// the optimizer state (fp32 master weights, exp_avg, exp_avg_sq...) as one
// safetensors file, the small objects of the optimizer and the trainer, and
// a manifest with a CRC32C per tensor, committed so that a crash at any
// point leaves the previous checkpoint loadable.
//
// Save writes synchronously. Engine is the lazy checkpointer of
// DataStates-LLM: Save hands it a snapshot and returns at once; copier
// goroutines capture it into a bounded pinned ring, group by group (the
// source may change a group's memory as soon as the group is captured:
// copy-on-write per optimizer subgroup), and writer goroutines place the
// chunks with O_DIRECT. Both use the same layout, computed before any byte
// is written so that data can be placed with positioned writes in any
// order, and the same commit; their files are byte for byte the same.
//
// # Layout on disk
//
//	root/
//	├── .lock                         held (flock) by the one process that writes here; its PID
//	├── latest                        "step-000000020\n": names the committed checkpoint
//	├── step-000000010/               an older committed checkpoint
//	├── step-000000020/
//	│   ├── rank-00000.safetensors    the tensors of rank 0 (see below)
//	│   ├── index.json                {"metadata": {"total_size": N}, "weight_map": {name: file}}
//	│   └── manifest.json             written last: format, version, step, rank, world_size,
//	│                                 created, files, tensors (name, file, dtype, shape,
//	│                                 offset, bytes, crc32c), objects
//	├── .tmp-retired-step-000000005-… a checkpoint being removed by retention, or left by a crash
//	├── damaged-step-000000030-…/     set aside by Rollback (dos ckpt recover): did not verify
//	└── .tmp-step-000000030-1f2e3d4c/ a save in progress, or left by a crash: ignored
//
// The safetensors file, readable by Hugging Face's safetensors package
// (safe_open), with __metadata__ {"format": "pt", "step": "20", "producer":
// "dos"}:
//
//	offset 0        8                   8+H (a multiple of 8)                      size
//	       +--------+-------------------+--------------+-----+-------------------+
//	       | H: u64 | header JSON, H B  | tensor 0     | ... | tensor n-1        |
//	       +--------+-------------------+--------------+-----+-------------------+
//	                                    ^ manifest "offset" of tensor 0, "bytes" long
//
// Tensors are stored in the order of Snapshot.Tensors, without gaps, each
// as its little-endian bytes. A manifest offset is absolute (from the start
// of the file), in bytes. The CRC32C is the Castagnoli CRC-32 of the
// tensor's bytes, as hash/crc32 computes it with crc32.Castagnoli.
//
// One process writes under a root at a time: Save, Engine, Retain and
// Recover take the root's lock (Lock, flock(2) on root/.lock, released by
// the kernel however the process ends), and another process is refused
// with ErrLocked, naming the holder. A trainer holds it for its whole run.
// Each rank of a multi-rank job saves into a root of its own under the
// job's root (RankRoot), with the commit below; the job commits a step in
// a latest of its own once every rank's save of it is durable (CommitJob,
// JobLatest, RewindRank: job.go), and the single-rank functions refuse a
// job's root (ErrJobRoot).
//
// # Fresh, sound and damaged roots
//
// A root is fresh when it holds no latest, no latest.tmp and no step
// directory (Inspect, RootInfo.Fresh); sound when latest names a complete
// step directory; damaged otherwise: latest missing while step directories
// or latest.tmp exist (a first commit interrupted between steps 7 and 10
// below, or latest removed), or latest empty, garbage, not a regular file,
// or naming an incomplete directory. Latest and List report a damaged root
// with ErrCorrupt, never as empty (ErrNoCheckpoint), and Save refuses to
// write into it, since it would adopt or replace checkpoints that nothing
// marks. Recover repairs it: it finishes the interrupted commit, or points
// latest at the newest step directory that verifies, and says which.
// Rollback also handles a sound latest whose checkpoint does not verify:
// it sets that checkpoint aside whole (root/damaged-step-%09d-<time>,
// never loaded or removed) and points latest at the newest that does;
// when none does, it sets every step directory aside so and removes
// latest, leaving a root without a checkpoint, where a new run may start
// (ErrNoneLeft). A
// step directory (one holding manifest.json, or step-%09d beside a
// latest) is never taken as a root. Readers (Latest, Inspect, OpenPath)
// take no lock: when a writer moves latest while they read, they read
// again.
//
// # Commit
//
// Save performs these steps, in order, and returns only after the last:
//
//  1. Take the root's lock. Create root if needed (and fsync its parent).
//     Read latest; refuse a damaged root. Remove stale .tmp-* directories,
//     and a step directory of the same step that is not committed (above
//     latest's step, or incomplete: a crash left it); refuse to replace a
//     committed one (at or below latest's step, complete).
//  2. Create the temporary directory root/.tmp-step-%09d-<random>.
//  3. Create rank-%05d.safetensors in it, write the header, then each
//     tensor at its precomputed offset with positioned writes (WriteAt),
//     computing its CRC32C while writing; fsync the file and close it.
//  4. Write index.json and fsync it.
//  5. Write manifest.json, last, and fsync it.
//  6. fsync the temporary directory.
//  7. Rename the temporary directory to root/step-%09d.
//  8. fsync root.
//  9. Write root/latest.tmp holding "step-%09d\n" and fsync it.
//  10. Rename latest.tmp to latest (atomic).
//  11. fsync root: the checkpoint is committed.
//
// On an error Save removes what it created (best effort) and latest still
// names the previous checkpoint; when step 11 fails, Save writes the
// previous latest back. A crash before step 10 leaves latest naming the
// previous checkpoint; a crash after it leaves a complete new one, since
// every file and directory it names was fsynced first. A crash between
// steps 7 and 11 may leave a complete step directory that latest does not
// name: Latest ignores it, List leaves it out when its step is above
// latest's, and the next Save of that step replaces it; in a root's first
// commit there is no latest yet, so the root is damaged until Recover
// finishes the commit.
//
// # Retention
//
// Retain (EngineOptions.Keep after each commit) retires each checkpoint
// beyond the newest N by renaming it out of the step namespace
// (.tmp-retired-*), fsyncing root, then removing it: a crash at any point
// leaves the whole checkpoint or a leftover that the next save or Retain
// removes, never a step directory without its manifest.
//
// # Loading
//
// Latest finds the committed directory; Open reads its manifest, index and
// safetensors header and checks that they agree, without reading tensor
// data; ReadTensor reads one tensor into the caller's memory and checks its
// CRC32C; Verify checks them all. Bad contents never panic: they give
// errors wrapping ErrCorrupt that name the file and the tensor. All I/O
// goes through the FS interface, so that tests inject a failure at every
// operation and simulate crashes, in the manner of pebble's errorfs.
//
// References:
//   - Maurya, Underwood, Rafique, Cappello, Nicolae. DataStates-LLM: Lazy
//     Asynchronous Checkpointing for Large Language Models. HPDC 2024
//     (state providers, lazy capture, flush, and the commit protocol).
//   - Hugging Face safetensors format: https://github.com/huggingface/safetensors
//   - Pillai et al. All File Systems Are Not Created Equal: On the Complexity
//     of Crafting Crash-Consistent Applications. OSDI 2014 (why the fsyncs of
//     files and directories around each rename).
package checkpoint
