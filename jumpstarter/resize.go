package jumpstarter

import (
	"context"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
)

// Resizer is a Target whose memory and disk can be resized for its next
// power on: the root driver's set_memory_size and set_disk_size
// (upstream's Qemu driver, `j resize memory|disk SIZE`). The exporter
// parses the size (ParseSize); the target decides whether it can give it
// and refuses at the call, wrapping ErrInvalidArgument for a size it will
// never give (too small, over a limit or over what the node has). A
// target that is no Resizer answers both calls Unimplemented.
type Resizer interface {
	// SetMemorySize makes the VM's RAM bytes from its next power on.
	SetMemorySize(ctx context.Context, bytes int64) error
	// SetDiskSize makes the VM's disk bytes (grown, never shrunk) from its
	// next power on.
	SetDiskSize(ctx context.Context, bytes int64) error
}

// byteUnits are pydantic's ByteSize units (case-insensitive): decimal
// b, kb... eb and their one-letter forms, binary kib... eib.
var byteUnits = map[string]float64{
	"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "pb": 1e15, "eb": 1e18,
	"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "e": 1e18,
	"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50, "eib": 1 << 60,
	"bit": 1.0 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8, "pbit": 1e15 / 8, "ebit": 1e18 / 8,
	"kibit": (1 << 10) / 8, "mibit": (1 << 20) / 8, "gibit": (1 << 30) / 8, "tibit": (1 << 40) / 8, "pibit": (1 << 50) / 8, "eibit": (1 << 60) / 8,
}

var (
	byteStringRE = regexp.MustCompile(`^\s*(\d*\.?\d+)\s*(\w+)?`)
	pyIntRE      = regexp.MustCompile(`^\s*[+-]?\d+(_\d+)*\s*$`)
)

// ParseSize reads a size as upstream's Qemu._parse_size does: a trailing
// k, m, g or t (any case) means KiB, MiB, GiB, TiB ("20G" is 20 GiB,
// "512M" 512 MiB); otherwise pydantic's ByteSize rules ("1GB" = 10^9,
// "2GiB", a plain number of bytes, "1.5G"). A size that does not parse, is
// not positive or does not fit in int64 bytes is an ErrInvalidArgument
// with upstream's message.
func ParseSize(size string) (int64, error) {
	bad := fmt.Errorf("%w: Invalid size: '%s'. Use e.g. '20G', '512M', '2T'", ErrInvalidArgument, size)
	if size == "" {
		return 0, bad
	}
	s := size
	if strings.ContainsRune("kmgtKMGT", rune(s[len(s)-1])) {
		s += "iB"
	}
	var n float64
	if pyIntRE.MatchString(s) {
		i, err := strconv.ParseInt(strings.ReplaceAll(strings.TrimSpace(s), "_", ""), 10, 64)
		if err != nil {
			return 0, bad
		}
		n = float64(i)
	} else {
		m := byteStringRE.FindStringSubmatch(s)
		if m == nil {
			return 0, bad
		}
		unit := strings.ToLower(m[2])
		if unit == "" {
			unit = "b"
		}
		mult, ok := byteUnits[unit]
		if !ok {
			return 0, bad
		}
		f, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			return 0, bad
		}
		n = math.Trunc(f * mult)
	}
	if n <= 0 {
		return 0, fmt.Errorf("%w: size '%s' must be more than 0 bytes", ErrInvalidArgument, size)
	}
	if n >= math.MaxInt64 {
		return 0, fmt.Errorf("%w: size '%s' is too large", ErrInvalidArgument, size)
	}
	return int64(n), nil
}

// resize serves set_memory_size and set_disk_size(size: str).
func (s *server) resize(ctx context.Context, method string, args []any) error {
	r, ok := s.e.cfg.Target.(Resizer)
	if !ok {
		return fmt.Errorf("%w: %s: this target cannot be resized", ErrUnsupported, method)
	}
	if len(args) != 1 {
		return fmt.Errorf("%w: %s takes one argument (size, e.g. \"2G\"), got %d", ErrInvalidArgument, method, len(args))
	}
	size, ok := args[0].(string)
	if !ok {
		return fmt.Errorf("%w: size must be a string such as \"2G\", got %s", ErrInvalidArgument, describeArg(args[0]))
	}
	n, err := ParseSize(size)
	if err != nil {
		return err
	}
	what := "memory"
	if method == "set_disk_size" {
		what = "disk"
	}
	s.e.logs.Add(LogEntry{Driver: "root", Operation: method, Message: fmt.Sprintf("%s size %s (%d bytes) requested for the next power on", what, size, n)})
	if method == "set_disk_size" {
		err = r.SetDiskSize(ctx, n)
	} else {
		err = r.SetMemorySize(ctx, n)
	}
	if err != nil {
		s.e.logs.Add(LogEntry{Driver: "root", Operation: method, Severity: SeverityError, Message: fmt.Sprintf("%s size %s refused: %v", what, size, err)})
		return err
	}
	s.e.logs.Add(LogEntry{Driver: "root", Operation: method, Message: fmt.Sprintf("%s will be %s on next power on", what, size)})
	return nil
}
