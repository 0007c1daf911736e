package trainer

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestGPT2Vocab: the vocab.json and merges.txt derived from r50k_base are
// GPT-2's (known entries), and byte-pair encoding with the merges gives
// tiktoken's ids.
func TestGPT2Vocab(t *testing.T) {
	vocab, merges, err := gpt2Vocab()
	if err != nil {
		t.Fatal(err)
	}
	if len(vocab) != 50257 || len(merges) != 50000 {
		t.Fatalf("%d vocab entries, %d merges; want GPT-2's 50257 and 50000", len(vocab), len(merges))
	}
	for tok, id := range map[string]int{"!": 0, "Ġthe": 262, "Ġt": 256, "Hello": 15496, "Ġworld": 995, "<|endoftext|>": 50256, "Ċ": 198} {
		if vocab[tok] != id {
			t.Errorf("vocab[%q] = %d, want %d", tok, vocab[tok], id)
		}
	}
	if merges[0] != [2]string{"Ġ", "t"} || merges[1] != [2]string{"Ġ", "a"} {
		t.Errorf("first merges %v %v, want [Ġ t] [Ġ a] (GPT-2's merges.txt)", merges[0], merges[1])
	}
	rank := map[string]int{}
	for i, m := range merges {
		rank[m[0]+" "+m[1]] = i
	}
	u := byteToUnicode()
	tok, _ := NewTokenizer("gpt2")
	for _, word := range []string{"Hello", " world", " refrangibility", " Newton", " Opticks", " colours", "1704", " ==>", " Ç"} {
		var parts []string
		for i := 0; i < len(word); i++ {
			parts = append(parts, string(u[word[i]]))
		}
		for {
			best, at := len(merges), -1
			for i := 0; i+1 < len(parts); i++ {
				if r, ok := rank[parts[i]+" "+parts[i+1]]; ok && r < best {
					best, at = r, i
				}
			}
			if at < 0 {
				break
			}
			parts[at] += parts[at+1]
			parts = append(parts[:at+1], parts[at+2:]...)
		}
		want, err := tok.Encode([]byte(word))
		if err != nil {
			t.Fatal(err)
		}
		var got []uint16
		for _, p := range parts {
			got = append(got, uint16(vocab[p]))
		}
		if !slices.Equal(got, want) {
			t.Errorf("%q: the merges give %v, tiktoken %v", word, got, want)
		}
	}
	dir := t.TempDir()
	if err := writeGPT2Tokenizer(dir); err != nil {
		t.Fatal(err)
	}
	for _, f := range HFTokenizerFiles {
		if fi, err := os.Stat(filepath.Join(dir, f)); err != nil || fi.Size() == 0 {
			t.Errorf("%s: %v", f, err)
		}
	}
	m, _ := os.ReadFile(filepath.Join(dir, "merges.txt"))
	if !strings.HasPrefix(string(m), "#version: 0.2\nĠ t\nĠ a\n") {
		t.Errorf("merges.txt starts %q", string(m[:min(len(m), 40)]))
	}
}
