package trainer

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/deepstates/dos"
)

func TestGPT2Tokenizer(t *testing.T) {
	tok, err := NewTokenizer("gpt2")
	if err != nil {
		t.Fatal(err)
	}
	if tok.Name() != "gpt2" || tok.VocabSize() != 50257 {
		t.Fatalf("%s, vocabulary %d", tok.Name(), tok.VocabSize())
	}
	for _, tc := range []struct {
		text string
		want []uint16
	}{
		{"Hello world", []uint16{15496, 995}},
		{"", nil},
		{"<|endoftext|>", []uint16{27, 91, 437, 1659, 5239, 91, 29}}, // ordinary text, not the special token
	} {
		got, err := tok.Encode([]byte(tc.text))
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("Encode(%q) = %v, %v; want %v", tc.text, got, err, tc.want)
		}
	}
	for _, tc := range []struct {
		tokens []int32
		want   string
	}{
		{[]int32{15496, 995}, "Hello world"},
		{[]int32{50256}, "<|endoftext|>"},
		{[]int32{0, 1}, `!"`},
	} {
		got, err := tok.Decode(tc.tokens)
		if err != nil || string(got) != tc.want {
			t.Errorf("Decode(%v) = %q, %v; want %q", tc.tokens, got, err, tc.want)
		}
	}
	for _, bad := range []int32{50257, 50303, -1} {
		if _, err := tok.Decode([]int32{15496, bad}); err == nil || !strings.Contains(err.Error(), "not a GPT-2 token") {
			t.Errorf("Decode(%d) = %v, want an error", bad, err)
		}
	}
	// The whole of Opticks round-trips.
	toks, err := tok.Encode(dos.Opticks)
	if err != nil {
		t.Fatal(err)
	}
	back, err := tok.Decode(int32s(toks))
	if err != nil || !bytes.Equal(back, dos.Opticks) {
		t.Fatalf("Opticks: %d tokens decode to %d bytes (%v), want the text's %d", len(toks), len(back), err, len(dos.Opticks))
	}
	t.Logf("Opticks: %d bytes, %d GPT-2 tokens", len(dos.Opticks), len(toks))
	// Invalid UTF-8 becomes U+FFFD, a maximal invalid sequence at a time
	// (Python's errors="replace").
	a, _ := tok.Encode([]byte("a\xffb\xe2\x82 c"))
	b, _ := tok.Encode([]byte("a\uFFFDb\uFFFD c"))
	if !slices.Equal(a, b) {
		t.Errorf("invalid UTF-8: %v, want %v", a, b)
	}
}

func int32s(u []uint16) []int32 {
	out := make([]int32, len(u))
	for i, x := range u {
		out[i] = int32(x)
	}
	return out
}

// TestGPT2ChunksMatchWhole: encoding in chunks cut by safeCut, in
// parallel, gives the tokens of the whole text encoded at once, on
// Opticks and on random texts of spaces, newlines, letters, digits,
// apostrophes, punctuation, non-ASCII letters and spaces and invalid
// UTF-8.
func TestGPT2ChunksMatchWhole(t *testing.T) {
	whole := func(text []byte) []uint16 {
		gpt2Tok.init()
		ids, _, err := gpt2Tables.enc.Encode(string(text))
		if err != nil {
			t.Fatal(err)
		}
		out := make([]uint16, len(ids))
		for i, id := range ids {
			out[i] = uint16(id)
		}
		return out
	}
	check := func(name string, text []byte, chunk int) {
		t.Helper()
		g := &gpt2Tokenizer{chunk: chunk}
		got, err := g.Encode(text)
		if err != nil {
			t.Fatal(err)
		}
		if want := whole(text); !slices.Equal(got, want) {
			i := 0
			for i < min(len(got), len(want)) && got[i] == want[i] {
				i++
			}
			t.Fatalf("%s, chunks of %d: %d tokens, whole %d; first difference at token %d", name, chunk, len(got), len(want), i)
		}
	}
	check("Opticks", dos.Opticks[:20_000], 1)
	check("Opticks", dos.Opticks[:200_000], 4096)
	alphabet := []string{" ", " ", "  ", "\n", "\n\n", "\r\n", "\t", "a", "Z", "word", "x", "7", "42", "'", "'s", "'ll", "'T",
		".", ",", "!?", "-", "é", "中文", "\u00a0", "\u3000", "\u2028", "\xff", "\xe2\x82", "😀", "ǅ", "٣"}
	r := rand.New(rand.NewPCG(1, 2))
	for n := range 300 {
		var b []byte
		for range 1 + r.IntN(60) {
			b = append(b, alphabet[r.IntN(len(alphabet))]...)
		}
		check(fmt.Sprintf("random text %d %q", n, b), b, 1+r.IntN(8))
	}
}

func TestByteTokenizer(t *testing.T) {
	tok, err := NewTokenizer("byte")
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := NewTokenizer(""); d != tok {
		t.Errorf(`NewTokenizer("") = %v, want the byte tokenizer`, d)
	}
	if tok.Name() != "byte" || tok.VocabSize() != 256 {
		t.Fatalf("%s, vocabulary %d", tok.Name(), tok.VocabSize())
	}
	text := []byte("Of Light\x00\xff")
	toks, _ := tok.Encode(text)
	if !slices.Equal(toks, []uint16{79, 102, 32, 76, 105, 103, 104, 116, 0, 255}) {
		t.Errorf("Encode = %v", toks)
	}
	if back, err := tok.Decode(int32s(toks)); err != nil || !bytes.Equal(back, text) {
		t.Errorf("Decode = %q, %v", back, err)
	}
	if _, err := tok.Decode([]int32{256}); err == nil {
		t.Error("Decode(256) accepted")
	}
	if _, err := NewTokenizer("bpe"); err == nil || !strings.Contains(err.Error(), `--tokenizer "bpe": want byte or gpt2`) {
		t.Errorf("NewTokenizer(bpe) = %v", err)
	}
}
