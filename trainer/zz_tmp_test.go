package trainer

import (
	"testing"
	"time"
)

func TestZZTmp(t *testing.T) {
	c := Config{VocabSize: 256, NCtx: 64, NLayer: 4, NHead: 4, NEmbd: 128}
	p := InitParams(c, 1)
	g := zerosLike(p)
	m := NewModel[float32](c, 16, 64)
	tok, tg := randomTokens(1024, 256, 1), randomTokens(1024, 256, 2)
	m.Forward(p, tok, tg)
	m.Backward(p, g, 1)
	var f, b time.Duration
	for range 10 {
		s := time.Now()
		m.Forward(p, tok, tg)
		f += time.Since(s)
		s = time.Now()
		m.Backward(p, g, 1)
		b += time.Since(s)
	}
	t.Logf("forward %v backward %v", f/10, b/10)
}
