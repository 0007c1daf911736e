package trainer

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"

	"github.com/deepstates/dos/gpt"
	"github.com/tiktoken-go/tokenizer"
)

// Tokenizer turns text into token ids and back. dos train has two
// (TrainConfig.Tokenizer, --tokenizer):
//
//   - "byte": one token per byte, id = the byte's value (VocabSize 256): the
//     CPU demo's, which needs no vocabulary;
//   - "gpt2": GPT-2's byte-level BPE (OpenAI's r50k_base encoding, 50257
//     tokens, <|endoftext|> = 50256), through github.com/tiktoken-go/tokenizer,
//     which embeds the vocabulary and works offline.
//
// A Tokenizer is safe for concurrent use.
type Tokenizer interface {
	// Name is the tokenizer's name as --tokenizer and the checkpoint's
	// config spell it: "byte" or "gpt2".
	Name() string
	// VocabSize is the number of token ids: every id is in [0, VocabSize).
	// A model's vocab_size must be at least this (ids beyond it are never
	// produced: padding).
	VocabSize() int
	// Encode returns the tokens of text. Byte-level: one per byte. GPT-2:
	// what tiktoken's r50k_base encode_ordinary gives, with invalid UTF-8
	// first replaced by U+FFFD as Python's bytes.decode(errors="replace")
	// does; "<|endoftext|>" in the text is encoded as ordinary text.
	Encode(text []byte) ([]uint16, error)
	// Decode returns the bytes of tokens, concatenated (a GPT-2 token may
	// hold part of a UTF-8 sequence, so the result need not be valid UTF-8;
	// GPT-2's 50256 decodes to "<|endoftext|>").
	//
	// Errors: a token outside [0, VocabSize).
	Decode(tokens []int32) ([]byte, error)
}

// TokenizerNames returns the names NewTokenizer knows: byte, gpt2.
func TokenizerNames() []string { return []string{"byte", "gpt2"} }

// NewTokenizer returns the tokenizer called name ("byte" or "gpt2"; ""
// means "byte", the default of checkpoints that predate the field).
//
// Errors: an unknown name, listing the known ones.
func NewTokenizer(name string) (Tokenizer, error) {
	switch name {
	case "", "byte":
		return byteTokenizer{}, nil
	case "gpt2":
		return gpt2Tok, nil
	}
	return nil, fmt.Errorf("trainer: --tokenizer %q: want %s", name, strings.Join(TokenizerNames(), " or "))
}

// byteTokenizer is the byte-level tokenizer.
type byteTokenizer struct{}

func (byteTokenizer) Name() string   { return "byte" }
func (byteTokenizer) VocabSize() int { return VocabSize }

func (byteTokenizer) Encode(text []byte) ([]uint16, error) {
	out := make([]uint16, len(text))
	for i, b := range text {
		out[i] = uint16(b)
	}
	return out, nil
}

func (byteTokenizer) Decode(tokens []int32) ([]byte, error) {
	out := make([]byte, len(tokens))
	for i, t := range tokens {
		if t < 0 || t >= VocabSize {
			return nil, fmt.Errorf("trainer: token %d at %d is not a byte-level token (0..%d)", t, i, VocabSize-1)
		}
		out[i] = byte(t)
	}
	return out, nil
}

// gpt2Tok is the one GPT-2 tokenizer; its tables are built at first use.
var gpt2Tok = &gpt2Tokenizer{chunk: 64 << 10}

// gpt2EOT is GPT-2's <|endoftext|> token, the last of its vocabulary.
const gpt2EOT = gpt.GPT2VocabSize - 1

// gpt2Tokenizer is GPT-2's BPE. Encode cuts long texts into chunks at
// boundaries where the pre-tokenizer's pieces cannot straddle (see
// safeCut) and encodes them on GOMAXPROCS goroutines: the same tokens as
// the whole text at once, in a fraction of the time and memory (the
// regexp engine holds the whole input as runes, and the library returns a
// string per token).
type gpt2Tokenizer struct {
	chunk int // bytes per chunk (about); tests make it small
}

// gpt2Tables are GPT-2's tables, built at the first use of a gpt2Tokenizer.
var gpt2Tables struct {
	once   sync.Once
	enc    tokenizer.Codec // invalid UTF-8 replaced by U+FFFD before encoding
	pieces []string        // id -> its bytes, for Decode
}

func (*gpt2Tokenizer) Name() string   { return "gpt2" }
func (*gpt2Tokenizer) VocabSize() int { return gpt.GPT2VocabSize }

// init builds gpt2Tables once.
func (*gpt2Tokenizer) init() {
	t := &gpt2Tables
	t.once.Do(func() {
		enc, err := tokenizer.Get(tokenizer.R50kBase)
		if err != nil {
			panic(err) // r50k_base is compiled in
		}
		enc.SetErrorMode(tokenizer.ErrorModeReplace)
		t.enc = enc
		dec, _ := tokenizer.Get(tokenizer.R50kBase) // ErrorModeNone: the bytes as they are
		t.pieces = make([]string, gpt.GPT2VocabSize)
		for id := range gpt2EOT {
			s, err := dec.Decode([]uint{uint(id)})
			if err != nil {
				panic(fmt.Sprintf("trainer: r50k_base has no token %d: %v", id, err))
			}
			t.pieces[id] = s
		}
		t.pieces[gpt2EOT] = "<|endoftext|>"
	})
}

func (g *gpt2Tokenizer) Encode(text []byte) ([]uint16, error) {
	g.init()
	var cuts []int // chunk i is text[cuts[i]:cuts[i+1]]
	cuts = append(cuts, 0)
	for start := 0; start < len(text); {
		end := safeCut(text, start+g.chunk)
		cuts = append(cuts, end)
		start = end
	}
	out := make([][]uint16, len(cuts)-1)
	errs := make([]error, len(out))
	var wg sync.WaitGroup
	next := make(chan int)
	for range min(runtime.GOMAXPROCS(0), len(out)) {
		wg.Go(func() {
			for i := range next {
				ids, _, err := gpt2Tables.enc.Encode(string(text[cuts[i]:cuts[i+1]]))
				if err != nil {
					errs[i] = fmt.Errorf("trainer: GPT-2 BPE of bytes %d..%d: %w", cuts[i], cuts[i+1], err)
					continue
				}
				toks := make([]uint16, len(ids))
				for j, id := range ids {
					toks[j] = uint16(id)
				}
				out[i] = toks
			}
		})
	}
	for i := range out {
		next <- i
	}
	close(next)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return slices.Concat(out...), nil
}

// safeCut returns the first index i >= at (or len(text)) where GPT-2's
// pre-tokenizer can cut text in two without changing a piece: text[i] is a
// space, text[i+1] an ASCII letter and text[i-1] a printable ASCII
// character other than space. The pattern ('s|'t|'re|'ve|'m|'ll|'d|
// ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) has no lookbehind;
// the piece holding text[i-1] ends there (no alternative takes a
// non-space and then a space), and a piece starts at text[i] and is " "
// followed by letters whether or not anything comes before it. Being ASCII,
// the cut splits no UTF-8 sequence either, so replacing invalid UTF-8 per
// chunk is the same as on the whole text. TestGPT2ChunksMatchWhole checks
// it against the whole text at once.
func safeCut(text []byte, at int) int {
	for i := max(at, 1); i+1 < len(text); i++ {
		c, prev, next := text[i], text[i-1], text[i+1]
		if c == ' ' && prev > ' ' && prev < 0x7f && ('a' <= next && next <= 'z' || 'A' <= next && next <= 'Z') {
			return i
		}
	}
	return len(text)
}

func (g *gpt2Tokenizer) Decode(tokens []int32) ([]byte, error) {
	g.init()
	var b []byte
	for i, t := range tokens {
		if t < 0 || t > gpt2EOT {
			return nil, fmt.Errorf("trainer: token %d at %d is not a GPT-2 token (0..%d)", t, i, gpt2EOT)
		}
		b = append(b, gpt2Tables.pieces[t]...)
	}
	return b, nil
}
