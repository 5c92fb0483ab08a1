package qemu

import (
	"os"
	"strings"
	"testing"
)

func TestParseSmapsRollup(t *testing.T) {
	good := `55d0c0000000-7ffd4e5f1000 ---p 00000000 00:00 0                          [rollup]
Rss:              209920 kB
Pss:              204800 kB
Pss_Dirty:        186368 kB
Pss_Anon:         186000 kB
Shared_Clean:       8192 kB
Anonymous:        186368 kB
Swap:                  0 kB
`
	rss, pss, anon, err := parseSmapsRollup([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if rss != 209920<<10 || pss != 204800<<10 || anon != 186368<<10 {
		t.Fatalf("rss %d pss %d anon %d", rss, pss, anon)
	}
	for name, bad := range map[string]string{
		"empty":        "",
		"no pss":       "Rss: 10 kB\nAnonymous: 5 kB\n",
		"not a number": "Rss: 10 kB\nPss: x kB\nAnonymous: 5 kB\n",
		"negative":     "Rss: 10 kB\nPss: -1 kB\nAnonymous: 5 kB\n",
	} {
		if _, _, _, err := parseSmapsRollup([]byte(bad)); err == nil || !strings.Contains(err.Error(), "smaps_rollup") {
			t.Errorf("%s: want a smaps_rollup error, got %v", name, err)
		}
	}
}

// TestReadProcStatsSelf reads this test process: PSS and anonymous memory
// are filled and bounded by RSS.
func TestReadProcStatsSelf(t *testing.T) {
	st, err := readProcStats(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if st.RSSBytes <= 0 || st.PSSBytes <= 0 || st.AnonBytes <= 0 {
		t.Fatalf("stats not filled: %+v", st)
	}
	if st.PSSBytes > st.RSSBytes || st.AnonBytes > st.RSSBytes {
		t.Fatalf("pss %d or anon %d above rss %d", st.PSSBytes, st.AnonBytes, st.RSSBytes)
	}
	if _, err := readProcStats(1 << 30); err == nil {
		t.Fatal("want an error for a pid that does not exist")
	}
}
