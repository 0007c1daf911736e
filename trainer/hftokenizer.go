package trainer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/deepstates/dos/gpt"
)

// HFTokenizerFiles are the files ExportHF writes beside the model for a
// gpt2-tokenized checkpoint: Hugging Face's GPT2Tokenizer files, so that
// transformers.AutoTokenizer.from_pretrained(dir) loads GPT-2's tokenizer
// offline, without the hub.
var HFTokenizerFiles = []string{"vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"}

// byteToUnicode is GPT-2's bytes_to_unicode (openai/gpt-2 encoder.py): the
// printable bytes stand for themselves, the others for the code points
// from 256 up, in byte order.
func byteToUnicode() [256]rune {
	var m [256]rune
	printable := func(b int) bool {
		return b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE && b <= 0xFF
	}
	n := 0
	for b := range 256 {
		if printable(b) {
			m[b] = rune(b)
		} else {
			m[b] = rune(256 + n)
			n++
		}
	}
	return m
}

// gpt2Vocab returns GPT-2's vocab.json (token, in bytes_to_unicode's
// spelling, to id) and merges.txt's merges, in rank order, derived from
// r50k_base's ranks (a token's rank is its id): token r of two or more
// bytes is the merge of the two parts that byte-pair encoding of its
// bytes, with the merges of rank below r, ends with.
func gpt2Vocab() (map[string]int, [][2]string, error) {
	(&gpt2Tokenizer{}).init()
	pieces := gpt2Tables.pieces
	u := byteToUnicode()
	spell := func(s string) string {
		var b []rune
		for i := 0; i < len(s); i++ {
			b = append(b, u[s[i]])
		}
		return string(b)
	}
	rank := make(map[string]int, gpt2EOT)
	vocab := make(map[string]int, gpt.GPT2VocabSize)
	for id := range gpt2EOT {
		rank[pieces[id]] = id
		vocab[spell(pieces[id])] = id
	}
	vocab["<|endoftext|>"] = gpt2EOT
	merges := make([][2]string, 0, gpt2EOT-256)
	for id := 256; id < gpt2EOT; id++ {
		p := pieces[id]
		parts := make([]string, len(p))
		for i := range len(p) {
			parts[i] = p[i : i+1]
		}
		for len(parts) > 2 {
			best, at := id, -1
			for i := 0; i+1 < len(parts); i++ {
				if r, ok := rank[parts[i]+parts[i+1]]; ok && r < best {
					best, at = r, i
				}
			}
			if at < 0 {
				break
			}
			parts[at] += parts[at+1]
			parts = append(parts[:at+1], parts[at+2:]...)
		}
		if len(parts) != 2 {
			return nil, nil, fmt.Errorf("trainer: r50k_base token %d (%q) is not one merge of lower-ranked tokens", id, p)
		}
		merges = append(merges, [2]string{spell(parts[0]), spell(parts[1])})
	}
	return vocab, merges, nil
}

// writeGPT2Tokenizer writes HFTokenizerFiles into dir.
func writeGPT2Tokenizer(dir string) error {
	vocab, merges, err := gpt2Vocab()
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(vocab); err != nil {
		return err
	}
	var m bytes.Buffer
	m.WriteString("#version: 0.2\n")
	for _, mg := range merges {
		m.WriteString(mg[0] + " " + mg[1] + "\n")
	}
	const eot = "<|endoftext|>"
	config, err := json.MarshalIndent(map[string]any{
		"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "add_prefix_space": false,
		"bos_token": eot, "eos_token": eot, "unk_token": eot, "errors": "replace",
	}, "", "  ")
	if err != nil {
		return err
	}
	special, err := json.MarshalIndent(map[string]string{"bos_token": eot, "eos_token": eot, "unk_token": eot}, "", "  ")
	if err != nil {
		return err
	}
	for _, f := range []struct {
		name string
		data []byte
	}{{"vocab.json", buf.Bytes()}, {"merges.txt", m.Bytes()}, {"tokenizer_config.json", append(config, '\n')}, {"special_tokens_map.json", append(special, '\n')}} {
		if err := os.WriteFile(filepath.Join(dir, f.name), f.data, 0o644); err != nil {
			return err
		}
	}
	return nil
}
