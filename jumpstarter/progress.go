package jumpstarter

import (
	"fmt"
	"time"
)

// ProgressInterval is the most time between two progress lines of a
// transfer that keeps moving (a pull, a flash, a dump); a transfer of
// known size also gets a line each time it crosses a tenth of it.
const ProgressInterval = 2 * time.Second

// ProgressLines turns a transfer's byte counts into LogStream lines
// ("pulled 12.0 MiB of 48.0 MiB (25%)"), paced by progressDue: never a
// line per block. Not safe for concurrent use: the goroutine that moves
// the bytes owns it (an oci.PullOptions.Progress callback is called one
// at a time).
type ProgressLines struct {
	// Verb says what the bytes are: "pulled", "received", "dumped".
	Verb string
	// Emit gets each line.
	Emit func(line string)
	// Now is the clock (nil: time.Now).
	Now func() time.Time

	started bool
	last    time.Time // of the last line, or of the first update
	tenth   int64     // tenths of the total the last line reported
}

// Update reports done bytes of total (0: not known).
func (p *ProgressLines) Update(done, total int64) {
	now := time.Now()
	if p.Now != nil {
		now = p.Now()
	}
	if !p.started {
		p.started, p.last = true, now
	}
	due, tenth := progressDue(done, total, now.Sub(p.last), p.tenth)
	if !due {
		return
	}
	p.last, p.tenth = now, tenth
	p.Emit(progressLine(p.Verb, done, total))
}

// progressDue says whether a transfer at done bytes of total (0: unknown)
// deserves a line, since since the last one (which reported lastTenth
// tenths of the total), and the tenths the line reports: when it crossed
// a further tenth of a known total, or when ProgressInterval passed and
// bytes moved. Pure.
func progressDue(done, total int64, since time.Duration, lastTenth int64) (bool, int64) {
	tenth := lastTenth
	if total > 0 && done > 0 {
		tenth = min(done*10/total, 10)
	}
	if tenth > lastTenth {
		return true, tenth
	}
	return done > 0 && since >= ProgressInterval, tenth
}

// progressLine is "VERB 12.0 MiB of 48.0 MiB (25%)", or "VERB 12.0 MiB"
// without a total. Pure.
func progressLine(verb string, done, total int64) string {
	if total > 0 {
		return fmt.Sprintf("%s %s of %s (%d%%)", verb, mib(done), mib(total), min(done*100/total, 100))
	}
	return fmt.Sprintf("%s %s", verb, mib(done))
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
