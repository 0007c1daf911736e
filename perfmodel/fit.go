package perfmodel

import (
	"errors"
	"fmt"
	"math"

	"gonum.org/v1/gonum/stat"
)

// Point is one measurement: Size units (params, bytes or elements) took
// Seconds.
type Point struct {
	Size    float64 `json:"size"`
	Seconds float64 `json:"seconds"`
}

// Fit is time = LatencyS + size/Rate, fitted by least squares over Points.
type Fit struct {
	LatencyS float64 `json:"latency_s"` // seconds, >= 0
	Rate     float64 `json:"rate"`      // units per second, > 0 (params/s, bytes/s or elements/s)
	// Residual is the root mean square of the fit's relative errors over
	// its points (0.05: 5 %).
	Residual float64 `json:"residual"`
	Points   []Point `json:"points,omitempty"`
}

// Time returns the fitted seconds for size units.
func (f Fit) Time(size float64) float64 {
	if size <= 0 {
		return 0
	}
	return f.LatencyS + size/f.Rate
}

// zero reports whether the fit is absent (a zero value).
func (f Fit) zero() bool {
	return f.Rate == 0 && f.LatencyS == 0 && f.Residual == 0 && len(f.Points) == 0
}

// Bounds of a usable fit: rates up to 1e18 units/s, latencies up to an
// hour (so that a prediction stays finite).
const (
	maxRate    = 1e18
	maxLatency = 3600
)

// Valid reports whether the fit can be used: a rate from 1 to 1e18 units
// per second, a latency from 0 to an hour, a finite, non-negative
// residual.
func (f Fit) Valid() bool {
	return f.Rate >= 1 && f.Rate <= maxRate && f.LatencyS >= 0 && f.LatencyS <= maxLatency &&
		f.Residual >= 0 && !math.IsInf(f.Residual, 0)
}

// FitPoints fits time = latency + size/rate to pts by ordinary least
// squares (gonum's stat.LinearRegression of seconds on size). A negative
// intercept, which noise can give when the latency is tiny, is refitted
// through the origin (latency 0).
//
// Errors: fewer than 2 points, or sizes or times that are not positive and
// finite, or a slope that is not positive (times that fall with size).
func FitPoints(pts []Point) (Fit, error) {
	if len(pts) < 2 {
		return Fit{}, errors.New("perfmodel: a fit needs at least 2 points")
	}
	xs := make([]float64, len(pts))
	ys := make([]float64, len(pts))
	for i, p := range pts {
		if !(p.Size > 0) || !(p.Seconds > 0) || math.IsInf(p.Size, 0) || math.IsInf(p.Seconds, 0) {
			return Fit{}, fmt.Errorf("perfmodel: point %d (%g units in %g s): want positive, finite values", i, p.Size, p.Seconds)
		}
		xs[i], ys[i] = p.Size, p.Seconds
	}
	alpha, beta := stat.LinearRegression(xs, ys, nil, false)
	if alpha < 0 {
		alpha = 0
		_, beta = stat.LinearRegression(xs, ys, nil, true)
	}
	if !(beta > 0) {
		return Fit{}, fmt.Errorf("perfmodel: the times do not grow with size (slope %g s per unit)", beta)
	}
	f := Fit{LatencyS: alpha, Rate: 1 / beta, Points: append([]Point(nil), pts...)}
	var ss float64
	for _, p := range pts {
		rel := (f.Time(p.Size) - p.Seconds) / p.Seconds
		ss += rel * rel
	}
	f.Residual = math.Sqrt(ss / float64(len(pts)))
	return f, nil
}
