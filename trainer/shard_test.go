package trainer

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// llmcFile returns an llm.c token file: the header with magic, version
// and count, then the tokens.
func llmcFile(magic, version, count int32, tokens ...uint16) []byte {
	b := make([]byte, ShardHeaderBytes)
	binary.LittleEndian.PutUint32(b, uint32(magic))
	binary.LittleEndian.PutUint32(b[4:], uint32(version))
	binary.LittleEndian.PutUint32(b[8:], uint32(count))
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint16(b, t)
	}
	return b
}

func rawFile(tokens ...uint16) []byte {
	var b []byte
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint16(b, t)
	}
	return b
}

func parse(b []byte, vocab int) ([]uint16, ShardFormat, error) {
	return readTokens(bytes.NewReader(b), int64(len(b)), "f.bin", vocab)
}

func TestReadTokens(t *testing.T) {
	toks := []uint16{50256, 15496, 995, 0, 50256}
	var w bytes.Buffer
	if err := WriteTokens(&w, toks); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(w.Bytes(), llmcFile(20240520, 1, 5, toks...)) {
		t.Fatal("WriteTokens does not write llm.c's layout")
	}
	for _, tc := range []struct {
		file   []byte
		format ShardFormat
		want   []uint16
	}{
		{w.Bytes(), FormatLLMC, toks},
		{rawFile(toks...), FormatNanoGPT, toks},
		{llmcFile(20240520, 1, 0), FormatLLMC, []uint16{}},
		{rawFile(7), FormatNanoGPT, []uint16{7}},
		{llmcFile(0, 1, 0), FormatNanoGPT, nil}, // no magic: 512 raw tokens
	} {
		got, format, err := parse(tc.file, 50257)
		if err != nil || format != tc.format || (tc.want != nil && !slices.Equal(got, tc.want)) {
			t.Errorf("%d bytes: %v %s %v, want %v %s", len(tc.file), got, format, err, tc.want, tc.format)
		}
	}
	// A real file: ReadTokens reads what WriteTokens wrote.
	path := filepath.Join(t.TempDir(), "shard.bin")
	if err := os.WriteFile(path, w.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, format, err := ReadTokens(path, 50257); err != nil || format != FormatLLMC || !slices.Equal(got, toks) {
		t.Errorf("ReadTokens: %v %s %v", got, format, err)
	}
	for _, p := range []string{t.TempDir(), filepath.Join(t.TempDir(), "missing")} {
		if _, _, err := ReadTokens(p, 50257); err == nil {
			t.Errorf("ReadTokens(%s) accepted", p)
		}
	}
}

// TestReadTokensHostile: every malformed file is refused with an error
// naming the file and where it is wrong.
func TestReadTokensHostile(t *testing.T) {
	for _, tc := range []struct {
		name string
		file []byte
		want []string
	}{
		{"empty", nil, []string{"f.bin is empty"}},
		{"header cut short", llmcFile(20240520, 1, 0)[:100], []string{"f.bin: llm.c token file", "100 bytes", "header is cut short, at byte offset 100 of 1024"}},
		{"magic only", llmcFile(20240520, 1, 0)[:4], []string{"header is cut short, at byte offset 4"}},
		{"version 2", llmcFile(20240520, 2, 1, 5, 5), []string{"version 2 (byte offset 4)", "want version 1"}},
		{"version 0", llmcFile(20240520, 0, 0), []string{"version 0 (byte offset 4)"}},
		{"negative count", llmcFile(20240520, 1, -3), []string{"token count of -3 (byte offset 8)"}},
		{"huge count", llmcFile(20240520, 1, 1<<31-1, 1), []string{"truncated", "says 2147483647 tokens", "ends at byte offset 1026, in token 1"}},
		{"truncated", llmcFile(20240520, 1, 10, 1, 2, 3, 4, 5), []string{"f.bin: truncated", "says 10 tokens, 1044 bytes", "ends at byte offset 1034, in token 5"}},
		{"truncated mid-token", llmcFile(20240520, 1, 10, 1, 2, 3)[:1029], []string{"ends at byte offset 1029, in token 2"}},
		{"trailing bytes", append(llmcFile(20240520, 1, 2, 1, 2), 9), []string{"1 bytes after the 2 tokens", "from byte offset 1028 to 1029"}},
		{"odd raw", []byte{1, 0, 2}, []string{"f.bin: 3 bytes, an odd count", "at offset 2"}},
		{"one byte", []byte{1}, []string{"1 bytes, an odd count", "at offset 0"}},
		{"token out of the vocabulary, llm.c", llmcFile(20240520, 1, 3, 1, 50257, 2), []string{"f.bin: token 50257 at index 1 (byte offset 1026)", "vocabulary of 50257"}},
		{"token out of the vocabulary, raw", rawFile(1, 2, 3, 65535), []string{"token 65535 at index 3 (byte offset 6)"}},
	} {
		got, _, err := parse(tc.file, 50257)
		if err == nil {
			t.Errorf("%s: accepted, %d tokens", tc.name, len(got))
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q, want it to contain %q", tc.name, err, w)
			}
		}
	}
	// The vocabulary is the caller's: a byte-level vocabulary refuses 256.
	if _, _, err := parse(rawFile(255, 256), 256); err == nil || !strings.Contains(err.Error(), "token 256 at index 1 (byte offset 2) is outside the vocabulary of 256") {
		t.Errorf("vocab 256: %v", err)
	}
}

// FuzzReadTokens: no file's contents make readTokens panic, and what it
// accepts is consistent with the file.
func FuzzReadTokens(f *testing.F) {
	f.Add(llmcFile(20240520, 1, 2, 1, 2), 50257)
	f.Add(llmcFile(20240520, 1, 3, 1, 2), 50257)
	f.Add(llmcFile(20240520, 7, -1), 256)
	f.Add(rawFile(1, 2, 3), 4)
	f.Add([]byte{0x48, 0xd5, 0x34, 0x01, 1}, 50257)
	f.Fuzz(func(t *testing.T, b []byte, vocab int) {
		toks, format, err := parse(b, vocab)
		if err != nil {
			return
		}
		switch format {
		case FormatLLMC:
			if len(b) != ShardHeaderBytes+2*len(toks) {
				t.Fatalf("llm.c: %d bytes, %d tokens", len(b), len(toks))
			}
		case FormatNanoGPT:
			if len(b) != 2*len(toks) {
				t.Fatalf("nanoGPT: %d bytes, %d tokens", len(b), len(toks))
			}
		default:
			t.Fatalf("format %q", format)
		}
		for _, x := range toks {
			if int(x) >= vocab {
				t.Fatalf("token %d accepted with vocab %d", x, vocab)
			}
		}
	})
}

// llmcOrder is llm.c's DataLoader order written out from its definition:
// the positions of batches 0..n-1.
func llmcOrder(N, B, T, n int) []int {
	var ps []int
	p := 0
	for range n {
		ps = append(ps, p)
		p += B * T
		if p+B*T+1 > N {
			p = 0
		}
	}
	return ps
}

// TestTokenBatches: the batches are llm.c's, pass after pass; SeekBatch(i)
// lands where i calls of Next do, and SetPos takes only batch positions.
func TestTokenBatches(t *testing.T) {
	for _, tc := range []struct{ N, B, T int }{{9, 2, 4}, {10, 2, 4}, {17, 2, 4}, {100, 3, 5}, {31, 1, 30}, {64, 4, 3}} {
		toks := make([]uint16, tc.N)
		for i := range toks {
			toks[i] = uint16(1000 + i)
		}
		d, err := NewTokenBatches(toks, tc.B, tc.T)
		if err != nil {
			t.Fatal(err)
		}
		if want := int64((tc.N - 1) / (tc.B * tc.T)); d.Batches() != want {
			t.Errorf("%+v: Batches() = %d, want %d", tc, d.Batches(), want)
		}
		in, tg := make([]int32, tc.B*tc.T), make([]int32, tc.B*tc.T)
		for i, p := range llmcOrder(tc.N, tc.B, tc.T, 3*int(d.Batches())+2) {
			if d.Pos() != int64(p) {
				t.Fatalf("%+v: batch %d at %d, llm.c's at %d", tc, i, d.Pos(), p)
			}
			d.Next(in, tg)
			for b := range tc.B {
				for j := range tc.T {
					if in[b*tc.T+j] != int32(toks[p+b*tc.T+j]) || tg[b*tc.T+j] != int32(toks[p+b*tc.T+j+1]) {
						t.Fatalf("%+v: batch %d row %d col %d: %d -> %d", tc, i, b, j, in[b*tc.T+j], tg[b*tc.T+j])
					}
				}
			}
			s, _ := NewTokenBatches(toks, tc.B, tc.T)
			if err := s.SeekBatch(int64(i + 1)); err != nil || s.Pos() != d.Pos() {
				t.Fatalf("%+v: SeekBatch(%d) at %d, Next %d times at %d", tc, i+1, s.Pos(), i+1, d.Pos())
			}
			if err := s.SetPos(d.Pos()); err != nil {
				t.Fatalf("%+v: SetPos(%d): %v", tc, d.Pos(), err)
			}
		}
	}
	toks := make([]uint16, 17)
	d, _ := NewTokenBatches(toks, 2, 4) // batches at 0 and 8
	for _, bad := range []int64{-8, 4, 16, 24} {
		if err := d.SetPos(bad); err == nil {
			t.Errorf("SetPos(%d) accepted", bad)
		}
	}
	if err := d.SeekBatch(-1); err == nil {
		t.Error("SeekBatch(-1) accepted")
	}
	for _, tc := range []struct{ N, B, T int }{{8, 2, 4}, {0, 1, 1}, {10, 0, 4}, {10, 2, 0}} {
		if _, err := NewTokenBatches(make([]uint16, tc.N), tc.B, tc.T); err == nil {
			t.Errorf("NewTokenBatches(%+v) accepted", tc)
		}
	}
	// With at least B*T+1 tokens the text Loader reads the same batches.
	toks = make([]uint16, 50)
	for i := range toks {
		toks[i] = uint16(i)
	}
	d, _ = NewTokenBatches(toks, 3, 4)
	l, _ := NewLoader(toks, 3, 4)
	a, b, c, e := make([]int32, 12), make([]int32, 12), make([]int32, 12), make([]int32, 12)
	for i := range 20 {
		l.Next(a, b)
		d.Next(c, e)
		if !slices.Equal(a, c) || !slices.Equal(b, e) {
			t.Fatalf("batch %d: Loader %v, TokenBatches %v", i, a, c)
		}
	}
}
