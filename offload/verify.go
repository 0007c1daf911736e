package offload

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/safetensors"
)

// A checkpoint's CRC32C finds damage, not nonsense: a state that went NaN
// before it was saved, or a file written by another tool, checksums fine.
// These checks refuse values the optimizer never produces from finite
// gradients (which Step guarantees: it skips a step with an Inf or NaN
// gradient): a non-finite master weight, exp_avg, exp_avg_sq or
// max_exp_avg_sq, and a negative exp_avg_sq or max_exp_avg_sq (they are
// running means of squares; their square root is the denominator of the
// update). Loaded, a NaN spreads to every forward pass, and an Inf in
// exp_avg_sq freezes its element silently (the update becomes m/Inf = 0).

// stateScan checks one state tensor whose little-endian fp32 bytes are fed
// to it in order (scan: pieces of whole elements; feed: any pieces) and
// counts its bad values.
type stateScan struct {
	nonNeg   bool    // exp_avg_sq or max_exp_avg_sq: a value < 0 is bad too
	n        int64   // elements seen
	bad      int64   // bad elements seen
	first    int64   // index of the first bad element
	firstVal float32 // its value
	carry    [4]byte // feed's: the start of an element split between pieces
	nc       int     // its bytes
}

// newStateScan returns the scan for the state tensor name: every value
// finite, and >= 0 (-0.0 included) for the .exp_avg_sq and .max_exp_avg_sq
// suffixes.
func newStateScan(name string) stateScan {
	return stateScan{nonNeg: strings.HasSuffix(name, ExpAvgSqSuffix) || strings.HasSuffix(name, MaxExpAvgSqSuffix)}
}

// scan checks the elements in b, len(b)/4 of them (a multiple of 4 bytes),
// in one pass over their bits: two elements at a time and without a branch
// in blocks of 256, then a block with a bad value a second time, to find
// and count them.
func (s *stateScan) scan(b []byte) {
	// For an element's bits u: u&0x7f800000 + 0x00800000 reaches bit 31
	// when the exponent is all ones (Inf or NaN); u&0x7fffffff + 0x7fffffff
	// does when the magnitude is not zero, so u & that has bit 31 set for
	// a value < 0 (not -0.0). Neither sum carries out of its 32 bits, so
	// one uint64 holds two elements.
	const (
		exp, one, mag, high = 0x7f8000007f800000, 0x0080000000800000, 0x7fffffff7fffffff, 0x8000000080000000
	)
	neg := uint64(0)
	if s.nonNeg {
		neg = math.MaxUint64
	}
	for len(b) >= 4 {
		blk := b[:min(len(b), 1024)&^3]
		var acc uint64
		i := 0
		for ; i+8 <= len(blk); i += 8 {
			u := binary.LittleEndian.Uint64(blk[i:])
			acc |= (u&exp + one) | (u & neg & (u&mag + mag))
		}
		if i < len(blk) {
			u := uint64(binary.LittleEndian.Uint32(blk[i:]))
			acc |= (u&exp + one) | (u & neg & (u&mag + mag))
		}
		if acc&high != 0 {
			s.count(blk)
		}
		s.n += int64(len(blk) / 4)
		b = b[len(blk):]
	}
}

// feed checks the next bytes b of the tensor, a piece of any length: an
// element split between two pieces is checked once whole.
func (s *stateScan) feed(b []byte) {
	if s.nc > 0 {
		k := copy(s.carry[s.nc:], b)
		s.nc += k
		b = b[k:]
		if s.nc < len(s.carry) {
			return
		}
		s.scan(s.carry[:])
		s.nc = 0
	}
	whole := len(b) &^ 3
	s.scan(b[:whole])
	s.nc = copy(s.carry[:], b[whole:])
}

// piece feeds piece b, at byte offset off, of the state tensor name of size
// bytes in all, pieces coming in order (the callbacks of
// checkpoint.Checkpoint.VerifyFunc and checkpoint.Snapshot.Check): the
// first starts a new scan, the last returns the tensor's error (err; it
// does not name the tensor), the others nil.
func (s *stateScan) piece(name string, size, off int64, b []byte) error {
	if off == 0 {
		*s = newStateScan(name)
	}
	s.feed(b)
	if off+int64(len(b)) < size {
		return nil // more to come: the error counts the whole tensor
	}
	return s.err()
}

// count finds and counts the bad elements of blk, s.n being the index of
// its first.
func (s *stateScan) count(blk []byte) {
	for i := 0; i+4 <= len(blk); i += 4 {
		u := binary.LittleEndian.Uint32(blk[i:])
		if u&0x7f800000 == 0x7f800000 || s.nonNeg && u > 0x80000000 {
			if s.bad == 0 {
				s.first, s.firstVal = s.n+int64(i/4), math.Float32frombits(u)
			}
			s.bad++
		}
	}
}

// err describes the bad values seen, or returns nil when there are none.
// It does not name the tensor.
func (s *stateScan) err() error {
	if s.bad == 0 {
		return nil
	}
	want := "finite"
	if s.nonNeg {
		want = "finite, >= 0"
	}
	return fmt.Errorf("element %d is %v; %d of its %d elements fail the check (%s)", s.first, s.firstVal, s.bad, s.n, want)
}

// CheckState checks the values of one tensor of the optimizer state, named
// as in a checkpoint (NAME.master, NAME.exp_avg, NAME.exp_avg_sq,
// NAME.max_exp_avg_sq), v being its fp32 elements in row-major order: every
// value must be finite, and with the suffix .exp_avg_sq or .max_exp_avg_sq
// also >= 0 (-0.0 passes). Another name is checked for finiteness only.
// It makes one pass over v and allocates nothing when v passes.
// LoadCheckpoint and VerifyCheckpoint check with it, and trainer.LoadWeights
// checks the master weights it exports.
//
// Errors: an error wrapping checkpoint.ErrCorrupt that names the tensor, the
// index (in elements) and value of its first bad element, and how many of
// its elements are bad.
func CheckState(name string, v []float32) error {
	s := newStateScan(name)
	s.scan(safetensors.Float32View(v))
	if err := s.err(); err != nil {
		return fmt.Errorf("%w: tensor %q: %v", checkpoint.ErrCorrupt, name, err)
	}
	return nil
}

// isStateTensor reports whether a tensor of dtype d named name holds
// optimizer state that VerifyCheckpoint and a save check: F32, with one of
// the state suffixes.
func isStateTensor(d safetensors.DType, name string) bool {
	return d == safetensors.F32 && trimStateSuffix(name) != name
}

// VerifyCheckpoint checks the checkpoint c that an Optimizer saved
// (Snapshot, SaveCheckpoint, SaveAsync), reading every tensor once: what
// c.Verify checks (the CRC32C of every tensor), and the values that
// LoadCheckpoint would refuse in the same pass: every F32 tensor named
// NAME.master, NAME.exp_avg, NAME.exp_avg_sq or NAME.max_exp_avg_sq must be
// finite, and exp_avg_sq and max_exp_avg_sq >= 0 (CheckState). It also
// checks the "optimizer" object of c's manifest: it decodes, its format is
// this package's, its hyperparameters pass adam.Hyper.Validate, and its
// step is in [0, c.Manifest.Step]. The tensors of other names (a trainer's)
// are checksummed only. It does not compare c with an Optimizer's
// parameters or options: LoadCheckpoint does.
//
// Errors: errors wrapping checkpoint.ErrCorrupt: the first bad tensor's,
// naming the file, the tensor and, for a bad value, the index (in elements)
// and value of its first bad element and how many are bad, with a count of
// the other bad tensors (checkpoint.Checkpoint.VerifyFunc); and the
// optimizer object's, naming c.Dir; both when both are bad (errors.Join).
// An I/O error, alone.
func VerifyCheckpoint(c *checkpoint.Checkpoint) error {
	var s stateScan
	err := c.VerifyFunc(func(t checkpoint.TensorEntry, off int64, chunk []byte) error {
		if !isStateTensor(t.DType, t.Name) {
			return nil
		}
		return s.piece(t.Name, t.Bytes, off, chunk)
	})
	if err != nil && !errors.Is(err, checkpoint.ErrCorrupt) {
		return err
	}
	_, objErr := checkObject(c)
	return errors.Join(err, objErr)
}

// checkObject decodes and checks the optimizer object of c (format,
// hyperparameters, step); the errors wrap checkpoint.ErrCorrupt and name
// c.Dir.
func checkObject(c *checkpoint.Checkpoint) (optimizerObject, error) {
	var obj optimizerObject
	if err := c.Object(ObjectName, &obj); err != nil {
		return obj, fmt.Errorf("offload: %s: %w: optimizer object: %w", c.Dir, checkpoint.ErrCorrupt, err)
	}
	if obj.Format != objectFormat {
		return obj, fmt.Errorf("offload: %s: %w: optimizer object format %q, want %q", c.Dir, checkpoint.ErrCorrupt, obj.Format, objectFormat)
	}
	if err := obj.Hyper.Validate(); err != nil {
		return obj, fmt.Errorf("offload: %s: %w: optimizer object: %w", c.Dir, checkpoint.ErrCorrupt, err)
	}
	for g, grp := range obj.Options.Groups {
		h := obj.Hyper
		h.LR, h.WeightDecay = grp.LR, grp.WeightDecay
		if err := h.Validate(); err != nil {
			return obj, fmt.Errorf("offload: %s: %w: optimizer object: group %d: %w", c.Dir, checkpoint.ErrCorrupt, g, err)
		}
	}
	for _, p := range obj.Params {
		if p.Group < 0 || p.Group >= max(1, len(obj.Options.Groups)) {
			return obj, fmt.Errorf("offload: %s: %w: optimizer object: parameter %.80q in group %d of %d", c.Dir, checkpoint.ErrCorrupt, p.Name, p.Group, len(obj.Options.Groups))
		}
	}
	if obj.Step < 0 || obj.Step > c.Manifest.Step {
		return obj, fmt.Errorf("offload: %s: %w: optimizer step %d is outside [0, %d], the checkpoint's step", c.Dir, checkpoint.ErrCorrupt, obj.Step, c.Manifest.Step)
	}
	return obj, nil
}
