package adam

import (
	"fmt"
	"math"
)

// DType is the element type of a gradient or of the 16-bit working copy.
// The zero value means "none" where a DType is optional (Copy16).
type DType uint8

const (
	F32  DType = iota + 1 // IEEE 754 binary32
	BF16                  // bfloat16: the upper 16 bits of a binary32
	F16                   // IEEE 754 binary16
)

// String returns PyTorch's name: "float32", "bfloat16", "float16", or
// "none" for the zero value.
func (d DType) String() string {
	switch d {
	case 0:
		return "none"
	case F32:
		return "float32"
	case BF16:
		return "bfloat16"
	case F16:
		return "float16"
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// ParseDType parses PyTorch's names ("float32", "bfloat16", "float16"),
// their short forms ("fp32", "bf16", "fp16"), and "none" or "" as the zero
// value.
//
// Errors: any other name.
func ParseDType(s string) (DType, error) {
	switch s {
	case "", "none":
		return 0, nil
	case "float32", "fp32", "f32":
		return F32, nil
	case "bfloat16", "bf16":
		return BF16, nil
	case "float16", "fp16", "f16", "half":
		return F16, nil
	}
	return 0, fmt.Errorf("adam: unknown dtype %q: want float32, bfloat16, float16 or none", s)
}

// Size returns an element's size in bytes (0 for none).
func (d DType) Size() int {
	switch d {
	case F32:
		return 4
	case BF16, F16:
		return 2
	}
	return 0
}

// MarshalText implements encoding.TextMarshaler with String's names.
func (d DType) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler with ParseDType.
func (d *DType) UnmarshalText(b []byte) error {
	v, err := ParseDType(string(b))
	*d = v
	return err
}

// BF16ToF32 upcasts a bfloat16 bit pattern to float32 exactly.
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F32ToBF16 rounds f to bfloat16, to nearest with ties to even, as
// torch's .to(torch.bfloat16) does. NaN stays NaN (quieted); overflow gives
// infinity.
func F32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep sign and payload top, set quiet bit
		return uint16(b>>16) | 0x0040
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// F16ToF32 upcasts an IEEE binary16 bit pattern to float32 exactly,
// subnormals and infinities included; a NaN keeps its sign and payload and
// comes out quiet, as the F16C instruction VCVTPH2PS gives it.
func F16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	man := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f && man == 0: // inf
		return math.Float32frombits(sign | 0x7f800000)
	case exp == 0x1f: // NaN, quieted as F16C's VCVTPH2PS and PyTorch's conversion quiet it
		return math.Float32frombits(sign | 0x7fc00000 | man<<13)
	case exp != 0: // normal
		return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
	case man == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal: man * 2^-24, exact in float32.
	v := float32(man) * (1.0 / (1 << 24))
	return math.Float32frombits(sign | math.Float32bits(v))
}

// F32ToF16 rounds f to IEEE binary16, to nearest with ties to even, with
// gradual underflow to subnormals and overflow to infinity, as torch's
// .to(torch.float16) does. NaN stays NaN (quieted).
func F32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	man := b & 0x7fffff
	if exp == 0xff {
		if man != 0 {
			return sign | 0x7e00 | uint16(man>>13)
		}
		return sign | 0x7c00
	}
	e := exp - 112 // binary16 biased exponent
	if e >= 0x1f {
		return sign | 0x7c00
	}
	if e <= 0 {
		// Subnormal or zero in binary16: round (1.man * 2^(exp-127)) * 2^24.
		if e < -10 {
			return sign
		}
		m := man | 0x800000
		shift := uint32(14 - e) // 14..24
		q := m >> shift
		r := m & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if r > half || (r == half && q&1 == 1) {
			q++
		}
		return sign | uint16(q)
	}
	q := uint32(e)<<10 | man>>13
	r := man & 0x1fff
	if r > 0x1000 || (r == 0x1000 && q&1 == 1) {
		q++ // a carry into the exponent is right, up to infinity
	}
	return sign | uint16(q)
}
