//go:build !race

package adam

const raceEnabled = false
