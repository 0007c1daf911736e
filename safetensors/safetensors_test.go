package safetensors

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"
)

func sample(t testing.TB) []byte {
	b, err := Encode(map[string]string{"format": "pt"}, []Tensor{
		{Spec{"a", F32, []int64{2, 3}}, Float32Bytes([]float32{1, 2, 3, 4, 5, 6})},
		{Spec{"b", BF16, []int64{3}}, Uint16Bytes([]uint16{0x3f80, 0x4000, 0xbf80})},
		{Spec{"empty", F32, []int64{0, 4}}, nil},
		{Spec{"flag", U8, []int64{}}, []byte{1}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestRoundTrip(t *testing.T) {
	b := sample(t)
	if n := binary.LittleEndian.Uint64(b); (8+n)%8 != 0 {
		t.Errorf("data section starts at %d, not 8-aligned", 8+n)
	}
	f, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if f.Metadata["format"] != "pt" {
		t.Errorf("metadata %v", f.Metadata)
	}
	a, err := f.Float32("a")
	if err != nil || len(a) != 6 || a[5] != 6 {
		t.Errorf("a = %v, %v", a, err)
	}
	u, d, err := f.Uint16("b")
	if err != nil || d != BF16 || u[2] != 0xbf80 {
		t.Errorf("b = %v %v %v", u, d, err)
	}
	if ti, ok := f.Find("flag"); !ok || ti.NumElements() != 1 || len(ti.Shape) != 0 {
		t.Errorf("flag: %+v", ti)
	}
	if _, err := f.Float32("b"); err == nil {
		t.Error("Float32 of a BF16 tensor: no error")
	}
	if _, err := f.Float32("nope"); !errors.Is(err, ErrInvalid) {
		t.Errorf("missing tensor: %v", err)
	}
}

func TestInvalid(t *testing.T) {
	good := sample(t)
	hdr := func(js string) []byte {
		b := make([]byte, 8+len(js))
		binary.LittleEndian.PutUint64(b, uint64(len(js)))
		copy(b[8:], js)
		return b
	}
	for name, tc := range map[string]struct {
		b    []byte
		want string
	}{
		"short":      {good[:5], "shorter than"},
		"truncated":  {good[:len(good)-1], "data section"},
		"huge len":   {append([]byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0}, good[8:]...), "exceeds"},
		"not json":   {hdr("{nope"), "not a JSON"},
		"bad dtype":  {hdr(`{"x":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}}`), "unknown dtype"},
		"size":       {hdr(`{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`), "needs 8 bytes"},
		"negative":   {hdr(`{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`), "negative"},
		"overflow":   {hdr(`{"x":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}}`), "overflows"},
		"gap":        {append(hdr(`{"x":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`), 0, 0), "gap"},
		"overlap":    {append(hdr(`{"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"y":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`), 0, 0), "overlaps"},
		"no shape":   {hdr(`{"x":{"dtype":"U8","data_offsets":[0,0]}}`), "missing shape"},
		"bad md":     {hdr(`{"__metadata__":{"a":1}}`), "__metadata__"},
		"extra key":  {hdr(`{"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"z":1}}`), "bad entry"},
		"offsets 3":  {hdr(`{"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0,0]}}`), "data_offsets"},
		"reversed":   {hdr(`{"x":{"dtype":"U8","shape":[0],"data_offsets":[2,0]}}`), "bad data_offsets"},
		"null entry": {hdr(`{"x":null}`), "unknown dtype"},
		"key case":   {hdr(`{"x":{"Dtype":"U8","shape":[0],"data_offsets":[0,0]}}`), "unknown key"},
	} {
		_, err := Parse(tc.b)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want ErrInvalid containing %q", name, err, tc.want)
		}
	}
}

func TestLayoutErrors(t *testing.T) {
	for _, specs := range [][]Spec{
		{{"a", F32, []int64{1}}, {"a", F32, []int64{1}}},
		{{"", F32, []int64{1}}},
		{{"__metadata__", F32, []int64{1}}},
		{{"a", "Q8", []int64{1}}},
		{{"a", F32, []int64{-2}}},
	} {
		if _, _, _, err := Layout(nil, specs); err == nil {
			t.Errorf("Layout(%v): no error", specs)
		}
	}
	if _, err := Encode(nil, []Tensor{{Spec{"a", F32, []int64{2}}, []byte{1}}}); err == nil {
		t.Error("Encode with short data: no error")
	}
}

func FuzzParse(f *testing.F) {
	f.Add(sample(f))
	f.Add([]byte{})
	f.Add([]byte{2, 0, 0, 0, 0, 0, 0, 0, '{', '}'})
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := Parse(b)
		if err != nil {
			return
		}
		for _, ti := range p.Tensors {
			if _, _, err := p.Bytes(ti.Name); err != nil {
				t.Fatal(err)
			}
		}
	})
}
