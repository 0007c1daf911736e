package checkpoint

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"maps"
	"math"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"

	"github.com/deepstates/dos/safetensors"
)

// Checkpoint is one rank's opened checkpoint. Its manifest, index and
// safetensors headers were validated against each other by Open; tensor
// data is read, and its checksum verified, on demand.
//
// ReadTensor, Verify, Entry and Object may be called from several
// goroutines at once; Close must not run concurrently with them.
type Checkpoint struct {
	// Dir is the checkpoint directory, as passed to Open.
	Dir string
	// Manifest is the validated contents of manifest.json. Do not modify it.
	Manifest Manifest

	files  map[string]File // file name → open file
	byName map[string]int  // tensor name → index in Manifest.Tensors
}

func corruptf(file, format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrCorrupt, file, fmt.Sprintf(format, args...))
}

// isCorruptRead reports whether err from reading a file means that its
// contents are bad rather than that the file system failed.
func isCorruptRead(err error) bool {
	return errors.Is(err, safetensors.ErrInvalid) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, ErrCorrupt)
}

// Open opens the checkpoint of rank in dir. It reads and validates
// manifest.json (format, version, step, rank, names, dtypes, shapes, sizes
// and offsets), index.json, and the header of every safetensors file, and
// checks that all three agree: the same tensors with the same dtypes,
// shapes, sizes in bytes and offsets, exactly covering each file. It does
// not read tensor data: use ReadTensor or Verify. The caller must Close the
// Checkpoint.
//
// Errors: an error wrapping fs.ErrNotExist when dir has no manifest.json
// (not a committed checkpoint) or holds another rank's checkpoint; an error
// wrapping ErrCorrupt that names the file (and the tensor, when one is at
// fault) for any bad contents, including a missing index or safetensors
// file; or an I/O error. Open never panics on a file's contents.
func Open(fsys FS, dir string, rank int) (*Checkpoint, error) {
	mpath := filepath.Join(dir, ManifestFile)
	b, err := readSmallFile(fsys, mpath, maxJSONSize)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("checkpoint: %s is not a committed checkpoint: %w", dir, err)
		}
		if errors.Is(err, ErrCorrupt) { // too large
			return nil, err
		}
		return nil, fmt.Errorf("checkpoint: reading %s: %w", mpath, err)
	}
	c := &Checkpoint{Dir: dir, files: map[string]File{}}
	if err := decodeStrict(b, &c.Manifest); err != nil {
		return nil, corruptf(mpath, "%v", err)
	}
	if err := c.checkManifest(mpath); err != nil {
		return nil, err
	}
	if c.Manifest.Rank != rank {
		return nil, fmt.Errorf("checkpoint: %s holds rank %d, not rank %d: %w", dir, c.Manifest.Rank, rank, fs.ErrNotExist)
	}
	for _, name := range c.Manifest.Files {
		if err := c.openFile(fsys, name); err != nil {
			c.Close()
			return nil, err
		}
	}
	if err := c.checkIndex(fsys); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// decodeStrict decodes one JSON value into the struct that v points to.
// Every object key must name a field exactly as its tag spells it:
// encoding/json alone would also take "Shape" or "STEP", which Python's
// json readers of the same file would not see. It reads b twice (decode,
// then the keys), without copying it: a 256 MiB manifest is refused in
// seconds, in little more memory than its decoded form.
func decodeStrict(b []byte, v any) error {
	if err := json.Unmarshal(b, v); err != nil { // validates b first
		return err
	}
	s := keyScan{b: b}
	if err := s.value(reflect.TypeOf(v).Elem()); err != nil {
		var ke *keyError
		if errors.As(err, &ke) {
			return fmt.Errorf("unknown key %.40q in %s", ke.key, cmp.Or(ke.where, "the top level"))
		}
		return err
	}
	return nil
}

// keyError is an unknown key and where it stands (a JSON path).
type keyError struct{ key, where string }

func (e *keyError) Error() string { return "unknown key " + e.key + " in " + e.where }

// keyScan walks valid JSON, guided by the Go type it decodes into, and
// checks that every key of an object that decodes into a struct is one
// of the struct's json tags, exactly. Values of other types (maps, raw
// messages, scalars) are skipped without being decoded.
type keyScan struct {
	b []byte
	i int
}

var errJSONEnd = errors.New("unexpected end of JSON")

func (s *keyScan) space() {
	for s.i < len(s.b) && (s.b[s.i] == ' ' || s.b[s.i] == '\t' || s.b[s.i] == '\n' || s.b[s.i] == '\r') {
		s.i++
	}
}

// value checks the value at s.i, which decodes into type t.
func (s *keyScan) value(t reflect.Type) error {
	s.space()
	if s.i >= len(s.b) {
		return errJSONEnd
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch c := s.b[s.i]; {
	case c == '{' && t.Kind() == reflect.Struct:
		return s.object(t)
	case c == '[' && t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Struct:
		return s.array(t.Elem())
	}
	return s.skip()
}

func (s *keyScan) object(t reflect.Type) error {
	fields := tagsOf(t)
	s.i++ // {
	for {
		s.space()
		if s.i >= len(s.b) {
			return errJSONEnd
		}
		if s.b[s.i] == '}' {
			s.i++
			return nil
		}
		if s.b[s.i] == ',' {
			s.i++
			s.space()
		}
		raw, escaped, err := s.strSpan()
		if err != nil {
			return err
		}
		key := ""
		ft, ok := fields[string(raw)] // no allocation
		if escaped {
			if key, err = unquote(raw); err != nil {
				return err
			}
			ft, ok = fields[key]
		}
		if !ok {
			return &keyError{key: cmp.Or(key, string(raw))}
		}
		s.space()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return errJSONEnd
		}
		s.i++
		if err := s.value(ft); err != nil {
			var ke *keyError
			if errors.As(err, &ke) {
				ke.where = "." + cmp.Or(key, string(raw)) + ke.where
			}
			return err
		}
	}
}

func (s *keyScan) array(elem reflect.Type) error {
	s.i++ // [
	for n := 0; ; n++ {
		s.space()
		if s.i >= len(s.b) {
			return errJSONEnd
		}
		if s.b[s.i] == ']' {
			s.i++
			return nil
		}
		if s.b[s.i] == ',' {
			s.i++
		}
		if err := s.value(elem); err != nil {
			var ke *keyError
			if errors.As(err, &ke) {
				ke.where = fmt.Sprintf("[%d]%s", n, ke.where)
			}
			return err
		}
	}
}

// strSpan moves past the string at s.i and returns its bytes between the
// quotes, and whether they hold an escape. It allocates nothing.
func (s *keyScan) strSpan() ([]byte, bool, error) {
	if s.i >= len(s.b) || s.b[s.i] != '"' {
		return nil, false, errJSONEnd
	}
	start, escaped := s.i+1, false
	for s.i++; s.i < len(s.b); s.i++ {
		switch s.b[s.i] {
		case '\\':
			escaped = true
			s.i++
		case '"':
			s.i++
			return s.b[start : s.i-1], escaped, nil
		}
	}
	return nil, false, errJSONEnd
}

// unquote decodes the escapes of a JSON string's contents.
func unquote(raw []byte) (string, error) {
	var out string
	err := json.Unmarshal(append(append([]byte{'"'}, raw...), '"'), &out)
	return out, err
}

// skip moves past the value at s.i.
func (s *keyScan) skip() error {
	depth := 0
	for s.i < len(s.b) {
		switch c := s.b[s.i]; c {
		case '"':
			if _, _, err := s.strSpan(); err != nil {
				return err
			}
			if depth == 0 {
				return nil
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return nil // the end of a number or literal, last in its object or array
			}
			depth--
			if depth == 0 {
				s.i++
				return nil
			}
		case ',', ' ', '\t', '\n', '\r':
			if depth == 0 {
				return nil // the end of a number or literal
			}
		}
		s.i++
	}
	if depth != 0 {
		return errJSONEnd
	}
	return nil
}

// tagsCache maps a struct type to its fields' types by json tag.
var tagsCache sync.Map // reflect.Type → map[string]reflect.Type

func tagsOf(t reflect.Type) map[string]reflect.Type {
	if m, ok := tagsCache.Load(t); ok {
		return m.(map[string]reflect.Type)
	}
	m := map[string]reflect.Type{}
	addFields(m, t)
	tagsCache.Store(t, m)
	return m
}

// addFields adds the JSON keys of struct type t's fields to m, named as
// encoding/json names them: the tag's name, else the field's; "-" and
// unexported fields left out; an untagged embedded struct's fields
// promoted.
func addFields(m map[string]reflect.Type, t reflect.Type) {
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		ft := f.Type
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		switch {
		case name == "-" && f.Tag.Get("json") == "-":
		case f.Anonymous && name == "" && ft.Kind() == reflect.Struct:
			addFields(m, ft)
		case !f.IsExported():
		case name != "":
			m[name] = f.Type
		default:
			m[f.Name] = f.Type
		}
	}
}

// checkManifest validates the manifest on its own.
func (c *Checkpoint) checkManifest(mpath string) error {
	m := &c.Manifest
	if m.Format != Format || m.Version != Version {
		return corruptf(mpath, "format %.40q version %d, want %q version %d", m.Format, m.Version, Format, Version)
	}
	if m.Step < 0 {
		return corruptf(mpath, "negative step %d", m.Step)
	}
	if step, ok := parseStepDirName(filepath.Base(filepath.Clean(c.Dir))); ok && step != m.Step {
		return corruptf(mpath, "step %d in the directory of step %d", m.Step, step)
	}
	if m.WorldSize < 1 || m.Rank < 0 || m.Rank >= m.WorldSize {
		return corruptf(mpath, "rank %d out of range for world size %d", m.Rank, m.WorldSize)
	}
	if m.Created.IsZero() {
		return corruptf(mpath, "missing creation time")
	}
	if len(m.Files) == 0 {
		return corruptf(mpath, "no files")
	}
	if len(m.ObjectsCRC32C) != len(m.Objects) {
		return corruptf(mpath, "%d objects but %d object checksums", len(m.Objects), len(m.ObjectsCRC32C))
	}
	for name, v := range m.Objects {
		want, ok := m.ObjectsCRC32C[name]
		if !ok {
			return corruptf(mpath, "object %.80q has no checksum", name)
		}
		if crc, err := objectCRC(v); err != nil || crc != want {
			return corruptf(mpath, "object %.80q: crc32c %#08x, manifest says %#08x", name, crc, want)
		}
	}
	files := make(map[string]bool, len(m.Files))
	for _, f := range m.Files {
		if f == "" || f != filepath.Base(f) || f == "." || f == ".." || !strings.HasSuffix(f, ".safetensors") || files[f] {
			return corruptf(mpath, "bad or duplicate file name %.80q", f)
		}
		files[f] = true
	}
	c.byName = make(map[string]int, len(m.Tensors))
	for i, t := range m.Tensors {
		if t.Name == "" || t.Name == "__metadata__" {
			return corruptf(mpath, "tensor %d: invalid name %.80q", i, t.Name)
		}
		if _, dup := c.byName[t.Name]; dup {
			return corruptf(mpath, "tensor %q: listed twice", t.Name)
		}
		c.byName[t.Name] = i
		if !files[t.File] {
			return corruptf(mpath, "tensor %q: file %.80q is not among the files", t.Name, t.File)
		}
		if t.Shape == nil {
			return corruptf(mpath, "tensor %q: missing shape", t.Name)
		}
		n, ok := tensorBytes(t.DType, t.Shape)
		if !ok {
			return corruptf(mpath, "tensor %q: invalid dtype %.20q or shape %v", t.Name, t.DType, t.Shape)
		}
		if n != t.Bytes {
			return corruptf(mpath, "tensor %q: shape %v of %s needs %d bytes, manifest says %d", t.Name, t.Shape, t.DType, n, t.Bytes)
		}
		if t.Offset < 0 || t.Offset > math.MaxInt64-t.Bytes {
			return corruptf(mpath, "tensor %q: bad offset %d", t.Name, t.Offset)
		}
	}
	return nil
}

// checkIndex reads index.json and checks it against the manifest.
func (c *Checkpoint) checkIndex(fsys FS) error {
	ipath := filepath.Join(c.Dir, IndexFile)
	b, err := readSmallFile(fsys, ipath, maxJSONSize)
	if err != nil {
		if errors.Is(err, ErrCorrupt) { // too large
			return err
		}
		if errors.Is(err, fs.ErrNotExist) {
			return corruptf(ipath, "missing: %v", err)
		}
		return fmt.Errorf("checkpoint: reading %s: %w", ipath, err)
	}
	var ix index
	if err := decodeStrict(b, &ix); err != nil {
		return corruptf(ipath, "%v", err)
	}
	var total int64
	for _, t := range c.Manifest.Tensors {
		total += t.Bytes // bounded: the files' headers were checked against the manifest
		if f, ok := ix.WeightMap[t.Name]; !ok || f != t.File {
			return corruptf(ipath, "tensor %q: weight_map gives file %.80q, manifest %q", t.Name, f, t.File)
		}
	}
	if len(ix.WeightMap) != len(c.Manifest.Tensors) {
		return corruptf(ipath, "weight_map has %d tensors, manifest %d", len(ix.WeightMap), len(c.Manifest.Tensors))
	}
	if ix.Metadata.TotalSize != total {
		return corruptf(ipath, "total_size %d, manifest's tensors hold %d bytes", ix.Metadata.TotalSize, total)
	}
	return nil
}

// openFile opens the safetensors file name of the checkpoint, parses its
// header and checks it against the manifest.
func (c *Checkpoint) openFile(fsys FS, name string) error {
	path := filepath.Join(c.Dir, name)
	f, st, err := openRegular(fsys, path)
	if err != nil {
		if errors.Is(err, ErrCorrupt) {
			return err
		}
		if errors.Is(err, fs.ErrNotExist) {
			return corruptf(path, "missing: %v", err)
		}
		return fmt.Errorf("checkpoint: %w", err)
	}
	c.files[name] = f // closed by Close, also on error
	h, err := safetensors.ParseHeader(f, st.Size())
	if err != nil {
		if isCorruptRead(err) {
			return fmt.Errorf("%w: %s: %w", ErrCorrupt, path, err)
		}
		return fmt.Errorf("checkpoint: %s: %w", path, err)
	}
	if err := checkHeaderKeys(f, path, h); err != nil {
		return err
	}
	if want := fileMetadata(c.Manifest.Step); !maps.Equal(h.Metadata, want) {
		return corruptf(path, "header __metadata__ %.200v, want %v", h.Metadata, want)
	}
	var listed int
	for _, t := range c.Manifest.Tensors {
		if t.File == name {
			listed++
		}
	}
	if listed != len(h.Tensors) {
		return corruptf(path, "header has %d tensors, manifest lists %d for this file", len(h.Tensors), listed)
	}
	for _, ht := range h.Tensors {
		i, ok := c.byName[ht.Name]
		if !ok || c.Manifest.Tensors[i].File != name {
			return corruptf(path, "tensor %.80q: in the file but not in the manifest", ht.Name)
		}
		t := c.Manifest.Tensors[i]
		switch {
		case ht.DType != t.DType:
			return corruptf(path, "tensor %q: dtype %s in the file, %s in the manifest", t.Name, ht.DType, t.DType)
		case !slices.Equal(ht.Shape, t.Shape):
			return corruptf(path, "tensor %q: shape %v in the file, %v in the manifest", t.Name, ht.Shape, t.Shape)
		case h.DataOffset+ht.Begin != t.Offset || ht.End-ht.Begin != t.Bytes:
			return corruptf(path, "tensor %q: bytes [%d, %d) in the file, [%d, %d) in the manifest", t.Name,
				h.DataOffset+ht.Begin, h.DataOffset+ht.End, t.Offset, t.Offset+t.Bytes)
		}
	}
	return nil
}

// checkHeaderKeys checks that every tensor entry of the header has exactly
// the keys that the reference implementation reads, spelled as it spells
// them: encoding/json, which safetensors.ParseHeader uses, also accepts
// "Dtype" or "SHAPE", which Python's safetensors rejects.
func checkHeaderKeys(f File, path string, h *safetensors.Header) error {
	buf := make([]byte, h.DataOffset-8)
	if err := readFullAt(f, buf, 8); err != nil {
		if isCorruptRead(err) {
			return corruptf(path, "header: %v", err)
		}
		return fmt.Errorf("checkpoint: %s: reading header: %w", path, err)
	}
	var raw map[string]map[string]json.RawMessage
	if err := json.Unmarshal(buf, &raw); err != nil {
		return corruptf(path, "header: %v", err)
	}
	for name, entry := range raw {
		if name == "__metadata__" {
			continue
		}
		for k := range entry {
			if k != "dtype" && k != "shape" && k != "data_offsets" {
				return corruptf(path, "tensor %.80q: unknown header key %.40q", name, k)
			}
		}
	}
	return nil
}

// Close closes the checkpoint's files. Reads after Close fail.
func (c *Checkpoint) Close() error {
	var errs []error
	for name, f := range c.files {
		if err := f.Close(); err != nil {
			errs = append(errs, fmt.Errorf("checkpoint: closing %s: %w", filepath.Join(c.Dir, name), err))
		}
	}
	c.files = nil
	return errors.Join(errs...)
}

// Entry returns the manifest entry of the tensor name and true, or false
// when the checkpoint holds no such tensor.
func (c *Checkpoint) Entry(name string) (TensorEntry, bool) {
	i, ok := c.byName[name]
	if !ok {
		return TensorEntry{}, false
	}
	return c.Manifest.Tensors[i], true
}

func (c *Checkpoint) lookup(name string) (TensorEntry, File, error) {
	t, ok := c.Entry(name)
	if !ok {
		return t, nil, fmt.Errorf("checkpoint: %s: no tensor %q: %w", c.Dir, name, fs.ErrNotExist)
	}
	f, ok := c.files[t.File]
	if !ok {
		return t, nil, fmt.Errorf("checkpoint: %s: reading tensor %q after Close: %w", c.Dir, name, fs.ErrClosed)
	}
	return t, f, nil
}

// ReadTensor reads the bytes of the tensor name into the ranges dst, in
// order (their concatenation receives the tensor, as Tensor.Data was given
// to Save), and verifies the tensor's CRC32C. The ranges' total length must
// equal the tensor's size in bytes (Entry(name).Bytes). On error the
// contents of dst are unspecified.
//
// Errors: an error wrapping fs.ErrNotExist when there is no such tensor; an
// error when dst's length is wrong; an error wrapping ErrCorrupt, naming the
// file and the tensor, when the file ends early or the checksum differs; an
// I/O error.
func (c *Checkpoint) ReadTensor(name string, dst ...[]byte) error {
	t, f, err := c.lookup(name)
	if err != nil {
		return err
	}
	var total int64
	for _, d := range dst {
		total += int64(len(d))
	}
	if total != t.Bytes {
		return fmt.Errorf("checkpoint: ReadTensor %q: %d destination bytes, the tensor holds %d", name, total, t.Bytes)
	}
	path := filepath.Join(c.Dir, t.File)
	off := t.Offset
	var crc uint32
	for _, d := range dst {
		if len(d) == 0 {
			continue
		}
		if err := readFullAt(f, d, off); err != nil {
			return c.readError(path, name, err)
		}
		crc = crc32.Update(crc, castagnoli, d)
		off += int64(len(d))
	}
	if crc != t.CRC32C {
		return corruptf(path, "tensor %q: crc32c %#08x, manifest says %#08x", name, crc, t.CRC32C)
	}
	return nil
}

// verifyChunk is the buffer size of Verify, in bytes.
const verifyChunk = 4 << 20

// Verify reads every tensor of the checkpoint and checks its CRC32C,
// without keeping the data.
//
// Errors: an error wrapping ErrCorrupt that names the first bad tensor and
// file and counts the others; an I/O error.
func (c *Checkpoint) Verify() error { return c.VerifyFunc(nil) }

// VerifyFunc is Verify that also hands every tensor's bytes, as read, to
// check: chunks of at most 4 MiB in file order, off being the chunk's
// offset from the tensor's start in bytes (a multiple of 8, so a chunk
// never splits an element). It checks the contents as Verify checks the
// checksums, in the same pass: a checkpoint whose CRC32C matches can still
// hold values its owner never writes (offload.VerifyCheckpoint checks that
// the optimizer state is finite). check's error is wrapped with ErrCorrupt
// and the file and tensor's names unless it wraps ErrCorrupt already; a
// tensor whose checksum differs is reported as such, whatever check said.
// The chunk is reused after check returns. nil check is Verify.
//
// Errors: those of Verify, and check's.
func (c *Checkpoint) VerifyFunc(check func(t TensorEntry, off int64, chunk []byte) error) error {
	var buf []byte
	var first error
	var bad int
	for _, t := range c.Manifest.Tensors {
		_, f, err := c.lookup(t.Name)
		if err != nil {
			return err
		}
		if n := int(min(t.Bytes, verifyChunk)); len(buf) < n {
			buf = make([]byte, n)
		}
		err = c.verifyTensor(f, t, buf, check)
		if err == nil {
			continue
		}
		if !errors.Is(err, ErrCorrupt) {
			return err
		}
		if first == nil {
			first = err
		}
		bad++
	}
	if bad > 1 {
		return fmt.Errorf("%w (and %d more corrupt tensors)", first, bad-1)
	}
	return first
}

func (c *Checkpoint) verifyTensor(f File, t TensorEntry, buf []byte, check func(TensorEntry, int64, []byte) error) error {
	path := filepath.Join(c.Dir, t.File)
	var crc uint32
	var bad error
	for off, end := t.Offset, t.Offset+t.Bytes; off < end; {
		b := buf[:min(int64(len(buf)), end-off)]
		if err := readFullAt(f, b, off); err != nil {
			return c.readError(path, t.Name, err)
		}
		crc = crc32.Update(crc, castagnoli, b)
		if check != nil && bad == nil {
			bad = check(t, off-t.Offset, b)
		}
		off += int64(len(b))
	}
	if crc != t.CRC32C {
		return corruptf(path, "tensor %q: crc32c %#08x, manifest says %#08x", t.Name, crc, t.CRC32C)
	}
	if bad != nil {
		if errors.Is(bad, ErrCorrupt) {
			return bad
		}
		return fmt.Errorf("%w: %s: tensor %q: %w", ErrCorrupt, path, t.Name, bad)
	}
	return nil
}

func (c *Checkpoint) readError(path, name string, err error) error {
	if isCorruptRead(err) {
		return corruptf(path, "tensor %q: file ends before the tensor does (%v)", name, err)
	}
	return fmt.Errorf("checkpoint: %s: reading tensor %q: %w", path, name, err)
}

// readFullAt fills b from f at off; a short read returns io.ErrUnexpectedEOF.
func readFullAt(f File, b []byte, off int64) error {
	n, err := f.ReadAt(b, off)
	if n == len(b) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// Object decodes the object name of the snapshot (Manifest.Objects[name])
// into v with json.Unmarshal. When v points to a struct, every key of the
// object (and of the structs within it) must be one of their json tags,
// exactly, as for the manifest: encoding/json alone would take
// "Iteration" for "iteration" (and the later of the two when both are
// there), which Python's readers of the same file would not.
//
// Errors: an error wrapping fs.ErrNotExist when there is no such object;
// one wrapping ErrCorrupt for a key that no field has; json.Unmarshal's
// error.
func (c *Checkpoint) Object(name string, v any) error {
	raw, ok := c.Manifest.Objects[name]
	if !ok {
		return fmt.Errorf("checkpoint: %s: no object %q: %w", c.Dir, name, fs.ErrNotExist)
	}
	t := reflect.TypeOf(v)
	if t == nil || t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct {
		if err := json.Unmarshal(raw, v); err != nil {
			return fmt.Errorf("checkpoint: %s: object %q: %w", c.Dir, name, err)
		}
		return nil
	}
	if err := decodeStrict(raw, v); err != nil {
		var se *json.SyntaxError
		var te *json.UnmarshalTypeError
		if errors.As(err, &se) || errors.As(err, &te) {
			return fmt.Errorf("checkpoint: %s: object %q: %w", c.Dir, name, err)
		}
		return fmt.Errorf("%w: %s: object %q: %w", ErrCorrupt, c.Dir, name, err)
	}
	return nil
}
