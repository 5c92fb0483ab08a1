package jumpstarter

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestProgressDue: a line when a transfer of known size crosses a further
// tenth, else when ProgressInterval passed and bytes moved; never for
// nothing moved.
func TestProgressDue(t *testing.T) {
	for _, c := range []struct {
		name        string
		done, total int64
		since       time.Duration
		lastTenth   int64
		want        bool
		wantTenth   int64
	}{
		{"nothing yet", 0, 100, time.Minute, 0, false, 0},
		{"within the first tenth, early", 9, 100, time.Second, 0, false, 0},
		{"first tenth crossed", 10, 100, 0, 0, true, 1},
		{"same tenth, early", 19, 100, time.Second, 1, false, 1},
		{"same tenth, interval passed", 19, 100, ProgressInterval, 1, true, 1},
		{"two tenths at once", 35, 100, 0, 1, true, 3},
		{"done", 100, 100, 0, 9, true, 10},
		{"more than the total stays at ten", 150, 100, 0, 10, false, 10},
		{"unknown total, early", 1 << 30, 0, time.Second, 0, false, 0},
		{"unknown total, interval passed", 1, 0, ProgressInterval, 0, true, 0},
	} {
		got, tenth := progressDue(c.done, c.total, c.since, c.lastTenth)
		assert.Equal(t, c.want, got, c.name)
		assert.Equal(t, c.wantTenth, tenth, c.name)
	}
	assert.Equal(t, "pulled 12.0 MiB of 48.0 MiB (25%)", progressLine("pulled", 12<<20, 48<<20))
	assert.Equal(t, "received 1.5 MiB", progressLine("received", 3<<19, 0))
}

// TestProgressLines: a transfer of known size gets a line per tenth, not
// per block; one of unknown size a line per ProgressInterval.
func TestProgressLines(t *testing.T) {
	now := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	var lines []string
	p := &ProgressLines{Verb: "sent", Emit: func(l string) { lines = append(lines, l) }, Now: func() time.Time { return now }}
	const total = 100 << 20
	for done := int64(1 << 20); done <= total; done += 1 << 20 { // 100 blocks, 10 ms apart
		now = now.Add(10 * time.Millisecond)
		p.Update(done, total)
	}
	assert.Len(t, lines, 10, "%q", lines)
	assert.Equal(t, "sent 10.0 MiB of 100.0 MiB (10%)", lines[0])
	assert.Equal(t, "sent 100.0 MiB of 100.0 MiB (100%)", lines[9])

	lines = nil
	p = &ProgressLines{Verb: "received", Emit: func(l string) { lines = append(lines, l) }, Now: func() time.Time { return now }}
	for i := int64(1); i <= 50; i++ { // 5 s of blocks, 100 ms apart
		now = now.Add(100 * time.Millisecond)
		p.Update(i<<20, 0)
	}
	assert.Equal(t, []string{"received 21.0 MiB", "received 41.0 MiB"}, lines, "every 2 s from the first block")
}
