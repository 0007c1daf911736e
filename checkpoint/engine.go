package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/deepstates/dos/internal/pinned"
)

// DirectMode says whether the Engine writes with O_DIRECT.
type DirectMode int

const (
	// DirectAuto tries O_DIRECT and falls back to buffered writes where the
	// file system refuses it with EINVAL (tmpfs, some overlay and network
	// file systems); Handle.Stats reports which was used.
	DirectAuto DirectMode = iota
	// DirectOn requires O_DIRECT: a file system that refuses it fails the
	// save.
	DirectOn
	// DirectOff writes through the page cache.
	DirectOff
)

// DirectAlign is the alignment of O_DIRECT writes: file offset, length and
// memory address are multiples of it (4096 bytes covers the logical block
// size of every common device).
const DirectAlign = 4096

// The Engine's default write shape: DefaultWriters positioned writes of
// DefaultChunkBytes in flight. On the GPU machine's disk (ext4 on a
// virtual disk) 8 writers of 16 MiB flushed 8 GiB at 1.72-2.05 GB/s where
// 4 of 8 MiB gave 1.43-1.59 GB/s in the same calls; on the development
// machine both reach 2.1-2.3 GB/s (BENCHMARKS.md, lazy checkpoints).
const (
	DefaultChunkBytes = 16 << 20
	DefaultWriters    = 8
)

// EngineOptions configures an Engine. The zero value is usable.
type EngineOptions struct {
	// RingBytes is the staging memory between capture and flush, in bytes
	// (default 256 MiB, at least 2 chunks): a page-aligned pinned.Arena
	// (O_DIRECT needs the alignment; the capture copies host memory, so
	// the ring is not page-locked). A full ring makes capture wait for the
	// writers (backpressure); it never grows.
	RingBytes int64
	// ChunkBytes is the unit of capture and of each positioned write, a
	// multiple of DirectAlign (default DefaultChunkBytes).
	ChunkBytes int64
	// Writers is the number of writer goroutines (default DefaultWriters).
	Writers int
	// Copiers is the number of goroutines that copy the snapshot into the
	// ring (default GOMAXPROCS/2, at least 1, at most 8): the capture runs
	// at memory speed, not one core's.
	Copiers int
	// Direct chooses O_DIRECT (default DirectAuto).
	Direct DirectMode
	// Keep is how many committed checkpoints to keep under root, the
	// newest; older ones are removed after each commit (0: keep all).
	Keep int
}

// Engine is the lazy asynchronous checkpointer of DataStates-LLM (Maurya
// et al., HPDC 2024: lazy capture, a bounded host buffer, background flush,
// and the commit protocol): Save takes a snapshot whose tensors
// are views of live state and returns at once. In the background copier
// goroutines capture the file image chunk by chunk into a bounded ring of
// pinned memory (reserved in file order), a checksum stage computes every
// tensor's CRC32C from the staged bytes in file order, and writer
// goroutines write each chunk at its offset with O_DIRECT
// (fallocated file, exact tail written through the page cache), then the
// file is synced and committed by the same protocol as Save (manifest last,
// renames, parent fsyncs, latest moved only after everything is durable).
// The source learns group by group when its memory may change again
// (Handle.WaitGroup): the next update of subgroup i waits only for
// subgroup i's capture, never for the disk unless the ring is full.
//
// One save runs at a time: Save waits for the previous one to be durable.
// An error of a background save is returned by its Handle and, once, by the
// next Save. Safe for concurrent use.
type Engine struct {
	fs    FS
	root  string
	opts  EngineOptions
	lock  *RootLock // the root's, from NewEngine to Close
	arena *pinned.Arena
	ring  *pinned.Ring

	mu  sync.Mutex
	cur *Handle // the save in flight, or the last one
	// reported tells whether cur's error, if any, was returned by Save or
	// Close already. The background save never takes mu: Save and Close
	// wait for it while holding mu.
	reported bool
	closed   bool
}

// NewEngine returns an engine that saves under root through fsys. It
// takes root's lock (Lock: creating root, checking that it can hold
// checkpoints) and holds it until Close.
//
// Errors: bad options; those of Lock (ErrLocked when another process
// writes under root, a root that is a step directory or not writable); the
// ring's memory failing to map or pin.
func NewEngine(fsys FS, root string, opts EngineOptions) (*Engine, error) {
	if opts.ChunkBytes == 0 {
		opts.ChunkBytes = DefaultChunkBytes
	}
	if opts.RingBytes == 0 {
		opts.RingBytes = 256 << 20
	}
	if opts.Writers == 0 {
		opts.Writers = DefaultWriters
	}
	if opts.Copiers == 0 {
		opts.Copiers = min(max(runtime.GOMAXPROCS(0)/2, 1), 8)
	}
	switch {
	case opts.ChunkBytes < 0 || opts.ChunkBytes%DirectAlign != 0:
		return nil, fmt.Errorf("checkpoint: ChunkBytes %d: want a positive multiple of %d", opts.ChunkBytes, DirectAlign)
	case opts.RingBytes < 2*opts.ChunkBytes:
		return nil, fmt.Errorf("checkpoint: RingBytes %d: want at least two chunks (%d)", opts.RingBytes, 2*opts.ChunkBytes)
	case opts.Writers < 0 || opts.Copiers < 0:
		return nil, fmt.Errorf("checkpoint: Writers %d, Copiers %d: want > 0", opts.Writers, opts.Copiers)
	case opts.Keep < 0:
		return nil, fmt.Errorf("checkpoint: Keep %d: want >= 0", opts.Keep)
	case opts.Direct < DirectAuto || opts.Direct > DirectOff:
		return nil, fmt.Errorf("checkpoint: Direct %d: unknown mode", opts.Direct)
	}
	lock, err := Lock(fsys, root)
	if err != nil {
		return nil, err
	}
	ringBytes := opts.RingBytes / opts.ChunkBytes * opts.ChunkBytes
	arena, err := pinned.New(nil, ringBytes+DirectAlign)
	if err != nil {
		lock.Unlock()
		return nil, fmt.Errorf("checkpoint: staging ring: %w", err)
	}
	buf, err := arena.Alloc(ringBytes, DirectAlign)
	if err != nil {
		arena.Free()
		lock.Unlock()
		return nil, fmt.Errorf("checkpoint: staging ring: %w", err)
	}
	return &Engine{fs: fsys, root: root, opts: opts, lock: lock, arena: arena, ring: pinned.NewRing(buf, true)}, nil
}

// Options returns the options in effect, defaults filled in. RingBytes is
// as given; the ring uses it rounded down to whole chunks.
func (e *Engine) Options() EngineOptions { return e.opts }

// Stats describes one background save.
type Stats struct {
	Step   int64
	Bytes  int64 // the safetensors file's size
	Direct bool  // O_DIRECT was used for the full chunks
	// Captured and Durable are the times from Save's return to the end of
	// the capture and to the commit.
	Captured, Durable time.Duration
}

// String describes the save for a log line: "step 20, 12.6 MB, captured
// in 3ms, durable in 18ms, O_DIRECT" (sizes below 0.1 MB in bytes).
func (s Stats) String() string {
	mode := "buffered"
	if s.Direct {
		mode = "O_DIRECT"
	}
	size := fmt.Sprintf("%.1f MB", float64(s.Bytes)/1e6)
	if s.Bytes < 100_000 {
		size = fmt.Sprintf("%d bytes", s.Bytes)
	}
	return fmt.Sprintf("step %d, %s, captured in %v, durable in %v, %s", s.Step, size,
		s.Captured.Round(time.Millisecond), s.Durable.Round(time.Millisecond), mode)
}

// Handle is one save handed to the Engine.
type Handle struct {
	step     int64
	start    time.Time
	captured chan struct{} // closed when every byte was captured (or the save failed)
	done     chan struct{} // closed when committed (or failed)
	groups   []chan struct{}

	mu    sync.Mutex
	err   error
	dir   string
	stats Stats
}

// WaitGroup blocks until capture group g (Tensor.Groups) is captured: from
// then on the source may change that group's memory. A group the snapshot
// does not have returns at once. The error is the save's, when it failed
// (the memory is free then too).
func (h *Handle) WaitGroup(g int) error {
	if g >= 0 && g < len(h.groups) {
		<-h.groups[g]
	}
	if isClosed(h.captured) || isClosed(h.done) {
		return h.Err()
	}
	return nil
}

// WaitCaptured blocks until the whole snapshot is captured (or the save
// failed): the source may then change any of its memory.
func (h *Handle) WaitCaptured() error {
	<-h.captured
	return h.Err()
}

// Captured reports, without blocking, whether the whole snapshot is
// captured (or the save failed): WaitCaptured would return at once.
func (h *Handle) Captured() bool { return isClosed(h.captured) }

// Wait blocks until the checkpoint is committed and durable, and returns
// its directory, or the save's error.
func (h *Handle) Wait() (string, error) {
	<-h.done
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.dir, h.err
}

// Done reports whether the save has finished, successfully or not.
func (h *Handle) Done() bool { return isClosed(h.done) }

// Err returns the save's error so far (nil while it runs well).
func (h *Handle) Err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// Stats returns the save's figures (complete once Wait returns).
func (h *Handle) Stats() Stats {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.stats
}

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// Save plans s and hands it to the background: it returns once the
// snapshot is checked and laid out, before any byte is copied. s's memory
// must stay unchanged until the handle reports its group captured
// (WaitGroup, WaitCaptured).
//
// Save first waits for the previous save to finish. Errors: an invalid
// snapshot (as Save's), the previous background save's error (once; s is
// then not saved), ErrClosed after Close. Panics as the package
// Save does.
func (e *Engine) Save(s *Snapshot) (*Handle, error) {
	if s == nil {
		panic("checkpoint: Engine.Save of a nil *Snapshot")
	}
	p, err := newPlan(s)
	if err != nil {
		return nil, fmt.Errorf("checkpoint: save step %d: %w", s.Step, err)
	}
	ngroups := 0
	for _, t := range s.Tensors {
		if t.Groups != nil && len(t.Groups) != len(t.Data) {
			return nil, fmt.Errorf("checkpoint: save step %d: tensor %q has %d groups for %d data ranges", s.Step, t.Name, len(t.Groups), len(t.Data))
		}
		for _, g := range t.Groups {
			if g < 0 || g >= MaxGroups {
				return nil, fmt.Errorf("checkpoint: save step %d: tensor %q: group %d outside [0, %d)", s.Step, t.Name, g, MaxGroups)
			}
			ngroups = max(ngroups, g+1)
		}
	}
	ngroups = max(ngroups, 1)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrClosed
	}
	if err := e.waitCur(); err != nil {
		return nil, fmt.Errorf("checkpoint: the previous save failed, step %d not saved: %w", s.Step, err)
	}
	h := &Handle{step: s.Step, start: time.Now(), captured: make(chan struct{}), done: make(chan struct{}), groups: make([]chan struct{}, ngroups),
		stats: Stats{Step: s.Step, Bytes: p.fileSize}}
	for i := range h.groups {
		h.groups[i] = make(chan struct{})
	}
	e.cur, e.reported = h, false
	go e.run(h, p, s)
	return h, nil
}

// MaxGroups bounds the capture groups of a snapshot (Tensor.Groups).
const MaxGroups = 1 << 20

// waitCur waits for the save in flight and returns its error if it failed
// and the error was not returned before. Hold e.mu.
func (e *Engine) waitCur() error {
	if e.cur == nil {
		return nil
	}
	<-e.cur.done
	if e.reported {
		return nil
	}
	e.reported = true
	return e.cur.Err()
}

// ErrClosed is returned by Engine.Save after Engine.Close.
var ErrClosed = errors.New("checkpoint: engine closed")

// Close waits for the save in flight, frees the ring, and returns that
// save's error if it failed and was not yet reported. Later Saves fail.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	err := e.waitCur()
	e.ring.Close()
	if ferr := e.arena.Free(); err == nil && ferr != nil {
		err = ferr
	}
	e.lock.Unlock()
	return err
}

// chunk is a captured piece of the file image on its way to a writer.
type chunk struct {
	span pinned.Span
	off  int64 // file offset
	n    int64 // bytes of the file in it (the span may be longer)
}

// piece is one Data range of the snapshot placed in the file.
type piece struct {
	data []byte
	off  int64 // file offset
}

// run is one background save: begin, capture and write concurrently, sync,
// commit, retention. It closes every channel of h whatever happens.
func (e *Engine) run(h *Handle, p *plan, s *Snapshot) {
	fl := e.newFlush(h, p, s)
	defer fl.cancel()
	fl.finish(fl.save())
}

// flush is one background save: the file cut into chunks, and the stages
// that each chunk passes in order: a reservation in the ring (reserve), the
// copy of its part of the file image (copy, Copiers goroutines), the
// checksums in file order (checksum, one goroutine), its positioned write
// (write, Writers goroutines) and the span's release; then the sync, the
// commit and retention (save).
type flush struct {
	e      *Engine
	h      *Handle
	p      *plan
	s      *Snapshot
	ctx    context.Context
	cancel context.CancelFunc
	once   sync.Once

	chunkBytes  int64
	nchunks     int
	pieces      []piece // the snapshot's data ranges in file order
	chunkGroups [][]int // per chunk, the capture groups it holds a piece of
	gmu         sync.Mutex
	left        []int // per group, its chunks not yet copied (under gmu)

	tx     *saveTx
	f, df  File               // the rank file, buffered and O_DIRECT (nil when unused)
	copied []chan pinned.Span // per chunk: its span once copied (an empty one after a failure)
	work   chan chunk         // checksummed chunks on their way to the writers
	crcs   []uint32           // per tensor
}

// copyJob is a chunk's reservation in the ring, for a copier.
type copyJob struct {
	k    int
	span pinned.Span
}

// newFlush lays s out in chunks: pieces in file order; for every chunk
// the groups it holds a piece of, and for every group how many chunks hold
// one (a group is captured when all its chunks are). A group without a
// byte is captured at once.
func (e *Engine) newFlush(h *Handle, p *plan, s *Snapshot) *flush {
	ctx, cancel := context.WithCancel(context.Background())
	C := e.opts.ChunkBytes
	fl := &flush{e: e, h: h, p: p, s: s, ctx: ctx, cancel: cancel, chunkBytes: C, nchunks: int((p.fileSize + C - 1) / C)}
	fl.chunkGroups = make([][]int, fl.nchunks)
	fl.left = make([]int, len(h.groups))
	// last[g] is the last chunk group g was added to: pieces come in file
	// order, so a group's chunks mostly do too, and the check is O(1) (a
	// chunk may hold millions of one-element subgroups' pieces, where a
	// search of its groups made a save quadratic); a chunk before it is
	// searched.
	last := make([]int, len(h.groups))
	for g := range last {
		last[g] = -1
	}
	for i, t := range s.Tensors {
		off := p.manifest.Tensors[i].Offset
		for j, r := range t.Data {
			g := 0
			if t.Groups != nil {
				g = t.Groups[j]
			}
			if len(r) > 0 {
				fl.pieces = append(fl.pieces, piece{data: r, off: off})
				for k := int(off / C); k <= int((off+int64(len(r))-1)/C); k++ {
					if k == last[g] || k < last[g] && slices.Contains(fl.chunkGroups[k], g) {
						continue
					}
					fl.chunkGroups[k] = append(fl.chunkGroups[k], g)
					fl.left[g]++
					last[g] = max(last[g], k)
				}
			}
			off += int64(len(r))
		}
	}
	for g, n := range fl.left {
		if n == 0 {
			close(h.groups[g])
		}
	}
	return fl
}

// fail records the save's first error and stops the stages.
func (fl *flush) fail(err error) {
	fl.once.Do(func() {
		fl.h.mu.Lock()
		fl.h.err = err
		fl.h.mu.Unlock()
		fl.cancel()
	})
}

// finish reports the save's end on its handle: the committed directory
// ("" after a failure), and every channel closed.
func (fl *flush) finish(dir string) {
	h := fl.h
	h.mu.Lock()
	if h.err == nil {
		h.dir = dir
	}
	h.stats.Durable = time.Since(h.start)
	h.mu.Unlock()
	for _, g := range h.groups {
		if !isClosed(g) {
			close(g)
		}
	}
	if !isClosed(h.captured) {
		close(h.captured)
	}
	close(h.done)
}

// save runs the stages and returns the committed directory, or "" after a
// failure (recorded by fail).
func (fl *flush) save() string {
	e, s := fl.e, fl.s
	if s.Prepare != nil {
		if err := s.Prepare(); err != nil {
			fl.fail(fmt.Errorf("checkpoint: save step %d: preparing the state: %w", s.Step, err))
			return ""
		}
	}
	// No other writer of this process between begin and retention (the
	// kernel's lock keeps other processes out).
	if err := e.lock.beginWrite(); err != nil {
		fl.fail(fmt.Errorf("checkpoint: save step %d: %w", s.Step, err))
		return ""
	}
	defer e.lock.endWrite()
	tx, err := begin(e.fs, e.root, fl.p)
	if err != nil {
		fl.fail(err)
		return ""
	}
	fl.tx = tx
	f, df, direct, err := e.create(tx)
	if err != nil {
		tx.abort()
		fl.fail(err)
		return ""
	}
	fl.f, fl.df = f, df
	fl.h.mu.Lock()
	fl.h.stats.Direct = direct
	fl.h.mu.Unlock()

	fl.work = make(chan chunk, fl.nchunks)
	fl.copied = make([]chan pinned.Span, fl.nchunks)
	for k := range fl.copied {
		fl.copied[k] = make(chan pinned.Span, 1)
	}
	fl.crcs = make([]uint32, len(s.Tensors))
	jobs := make(chan copyJob, fl.nchunks)
	var writers, copiers, checksums sync.WaitGroup
	for range e.opts.Writers {
		writers.Go(fl.write)
	}
	for range e.opts.Copiers {
		copiers.Go(func() { fl.copy(jobs) })
	}
	checksums.Go(fl.checksum)
	fl.reserve(jobs)
	copiers.Wait()
	if fl.ctx.Err() == nil {
		fl.h.mu.Lock()
		fl.h.stats.Captured = time.Since(fl.h.start)
		fl.h.mu.Unlock()
		close(fl.h.captured)
	}
	checksums.Wait()
	writers.Wait()
	return fl.commit()
}

// reserve reserves every chunk's span in the ring, in file order, and
// hands it to the copiers: a full ring waits for the writers
// (backpressure). After a failure it lets the checksum stage finish.
func (fl *flush) reserve(jobs chan<- copyJob) {
	k := 0
	for ; k < fl.nchunks && fl.ctx.Err() == nil; k++ {
		span, err := fl.e.ring.Reserve(fl.ctx, fl.chunkBytes)
		if err != nil {
			fl.fail(fl.tx.fail("staging ring", err))
			break
		}
		jobs <- copyJob{k, span}
	}
	close(jobs)
	for ; k < fl.nchunks; k++ {
		fl.copied[k] <- pinned.Span{}
	}
}

// copy fills each job's span with its chunk of the file image (header and
// pieces), then counts the chunk off its groups: a group whose chunks are
// all copied is captured, and its source memory may change.
func (fl *flush) copy(jobs <-chan copyJob) {
	C, p, pieces := fl.chunkBytes, fl.p, fl.pieces
	for j := range jobs {
		off := int64(j.k) * C
		n := min(C, p.fileSize-off)
		buf := j.span.Bytes()[:n]
		if off < int64(len(p.header)) {
			copy(buf, p.header[off:])
		}
		// The first piece ending after off, then those starting before off+n.
		i := sort.Search(len(pieces), func(i int) bool { return pieces[i].off+int64(len(pieces[i].data)) > off })
		for ; i < len(pieces) && pieces[i].off < off+n; i++ {
			pc := pieces[i]
			lo := max(off, pc.off)
			hi := min(off+n, pc.off+int64(len(pc.data)))
			copy(buf[lo-off:hi-off], pc.data[lo-pc.off:hi-pc.off])
		}
		fl.gmu.Lock()
		for _, g := range fl.chunkGroups[j.k] {
			if fl.left[g]--; fl.left[g] == 0 {
				close(fl.h.groups[g])
			}
		}
		fl.gmu.Unlock()
		fl.copied[j.k] <- j.span
	}
}

// checksum takes the copied chunks in file order (CRC32C is sequential
// within a tensor), adds them to their tensors' checksums, shows them to
// the snapshot's Check and passes them to the writers; after a failure it
// passes the spans on unwritten.
func (fl *flush) checksum() {
	defer close(fl.work)
	C, p := fl.chunkBytes, fl.p
	t := 0 // the first tensor that may overlap the chunk
	for k := range fl.nchunks {
		span := <-fl.copied[k] // every chunk comes, an empty span after a failure
		if fl.ctx.Err() != nil || span.Len == 0 {
			fl.work <- chunk{span: span} // the writers give the span back unwritten
			continue
		}
		off := int64(k) * C
		n := min(C, p.fileSize-off)
		buf := span.Bytes()[:n]
		for ; t < len(fl.crcs); t++ {
			te := &p.manifest.Tensors[t]
			lo, hi := max(off, te.Offset), min(off+n, te.Offset+te.Bytes)
			if lo < hi {
				fl.crcs[t] = crc32.Update(fl.crcs[t], castagnoli, buf[lo-off:hi-off])
				if check := fl.s.Check; check != nil && fl.ctx.Err() == nil {
					if err := check(t, lo-te.Offset, buf[lo-off:hi-off]); err != nil {
						fl.fail(fmt.Errorf("checkpoint: save step %d: %w", fl.s.Step, err))
					}
				}
			}
			if te.Offset+te.Bytes > off+n {
				break // continues in the next chunk
			}
		}
		fl.work <- chunk{span: span, off: off, n: n}
	}
}

// write writes each chunk at its offset (a full, aligned one through the
// O_DIRECT descriptor) and gives its span back to the ring.
func (fl *flush) write() {
	for c := range fl.work {
		if fl.ctx.Err() == nil && c.n > 0 {
			w := fl.f
			if c.n == fl.chunkBytes && fl.df != nil {
				w = fl.df
			}
			if err := writeFullAt(w, c.span.Bytes()[:c.n], c.off); err != nil {
				fl.fail(fl.tx.fail(fmt.Sprintf("write %s at %d", fl.tx.p.fileName, c.off), err))
			}
		}
		if c.span.Len > 0 {
			_ = fl.e.ring.Release(c.span)
		}
	}
}

// commit syncs and closes the file, commits the checkpoint (the package's
// protocol) and applies retention; it returns the directory, or "" after a
// failure.
func (fl *flush) commit() string {
	var err error
	if fl.ctx.Err() == nil {
		for i, crc := range fl.crcs {
			fl.tx.p.manifest.Tensors[i].CRC32C = crc
		}
		err = fl.e.syncClose(fl.tx, fl.f, fl.df)
	} else {
		closeQuiet(fl.f, fl.df)
		err = fl.h.Err()
	}
	if err != nil {
		fl.tx.abort()
		fl.fail(err)
		return ""
	}
	dir, err := fl.tx.commit()
	if err != nil {
		fl.fail(err)
		return ""
	}
	if fl.e.opts.Keep > 0 {
		_ = retain(fl.e.fs, fl.e.root, fl.e.opts.Keep) // housekeeping: a failure leaves old checkpoints
	}
	return dir
}

// create makes the rank file in the temporary directory, fallocates it
// when the file system allows, and opens a second, O_DIRECT descriptor for
// the full chunks (nil when not used).
func (e *Engine) create(tx *saveTx) (f, df File, direct bool, err error) {
	name := filepath.Join(tx.tmp, tx.p.fileName)
	f, err = tx.fs.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, nil, false, tx.fail("create "+tx.p.fileName, err)
	}
	if fd, ok := f.(interface{ Fd() uintptr }); ok && tx.p.fileSize > 0 {
		// Best effort: reserve the blocks up front (ext4, xfs) without
		// changing the size, so that the size check after writing still
		// catches a missing write; a file system without fallocate simply
		// grows the file as it is written.
		preallocate(fd.Fd(), tx.p.fileSize)
	}
	if e.opts.Direct == DirectOff {
		return f, nil, false, nil
	}
	if oDirect == 0 { // no O_DIRECT on this OS
		if e.opts.Direct == DirectOn {
			f.Close()
			return nil, nil, false, tx.fail("open "+tx.p.fileName+" with O_DIRECT", errors.New("O_DIRECT is not available on this operating system"))
		}
		return f, nil, false, nil
	}
	df, err = tx.fs.OpenFile(name, os.O_WRONLY|oDirect, 0)
	if err != nil {
		if e.opts.Direct == DirectAuto && errors.Is(err, syscall.EINVAL) {
			return f, nil, false, nil // the file system refuses O_DIRECT: buffered writes
		}
		f.Close()
		return nil, nil, false, tx.fail("open "+tx.p.fileName+" with O_DIRECT", err)
	}
	return f, df, true, nil
}

// syncClose makes the file durable and closes both descriptors.
func (e *Engine) syncClose(tx *saveTx, f, df File) error {
	st, err := f.Stat()
	if err == nil && st.Size() != tx.p.fileSize {
		err = fmt.Errorf("file holds %d bytes after writing, want %d", st.Size(), tx.p.fileSize)
	}
	if err != nil {
		closeQuiet(f, df)
		return tx.fail("stat "+tx.p.fileName, err)
	}
	if err := f.Sync(); err != nil {
		closeQuiet(f, df)
		return tx.fail("fsync "+tx.p.fileName, err)
	}
	if df != nil {
		if err := df.Close(); err != nil {
			f.Close()
			return tx.fail("close "+tx.p.fileName, err)
		}
	}
	if err := f.Close(); err != nil {
		return tx.fail("close "+tx.p.fileName, err)
	}
	return nil
}

func closeQuiet(fs ...File) {
	for _, f := range fs {
		if f != nil {
			_ = f.Close()
		}
	}
}
