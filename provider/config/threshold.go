package config

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/api/resource"
)

// Threshold is an "available" level: an absolute amount or a percentage of
// the total. The zero Threshold is disabled.
type Threshold struct {
	// Amount in base units (bytes, or a count of PIDs).
	Amount int64
	// Percent of the total, used when IsPercent.
	Percent   float64
	IsPercent bool
}

// ParseThreshold parses "10%" or a quantity such as "100Mi" or "1000".
func ParseThreshold(s string) (Threshold, error) {
	if strings.HasSuffix(s, "%") {
		v, err := strconv.ParseFloat(strings.TrimSuffix(s, "%"), 64)
		if err != nil || v < 0 || v > 100 || math.IsNaN(v) {
			return Threshold{}, fmt.Errorf("must be a percentage between 0%% and 100%%")
		}
		return Threshold{Percent: v, IsPercent: true}, nil
	}
	q, err := resource.ParseQuantity(s)
	if err != nil {
		return Threshold{}, fmt.Errorf("must be a quantity such as 100Mi or a percentage such as 10%%")
	}
	if q.Sign() < 0 {
		return Threshold{}, fmt.Errorf("must not be negative")
	}
	return Threshold{Amount: q.Value()}, nil
}

// Level returns the threshold in base units for a given total.
func (t Threshold) Level(total int64) int64 {
	if t.IsPercent {
		return int64(float64(total) * t.Percent / 100)
	}
	return t.Amount
}

// Crossed reports whether available is below the threshold (never for a
// disabled, zero threshold).
func (t Threshold) Crossed(available, total int64) bool {
	l := t.Level(total)
	return l > 0 && available < l
}

// String renders the threshold as it would be written in the file.
func (t Threshold) String() string {
	if t.IsPercent {
		return strconv.FormatFloat(t.Percent, 'f', -1, 64) + "%"
	}
	return resource.NewQuantity(t.Amount, resource.BinarySI).String()
}
