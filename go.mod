module github.com/deepstates/dos

go 1.26

require (
	github.com/ebitengine/purego v0.11.3
	github.com/klauspost/cpuid/v2 v2.4.2
	golang.org/x/sys v0.41.0
	gonum.org/v1/gonum v0.17.0
)
