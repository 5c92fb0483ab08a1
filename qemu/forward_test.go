package qemu

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestForwardFreePort(t *testing.T) {
	qmpDown := errors.New("QMP human-monitor-command: connection reset")
	taken := errors.New("could not set up host forwarding rule")
	pickErr := errors.New("find free loopback port: no ports")
	tests := []struct {
		name string
		// picks are the ports pick returns in turn; results what add
		// answers for each.
		picks   []int
		pickErr error
		results []error // taken = QEMU refused the port
		want    int
		wantErr error
		added   []int
	}{
		{name: "first port free", picks: []int{4001}, results: []error{nil}, want: 4001, added: []int{4001}},
		{name: "port taken since picked: a new one", picks: []int{4001, 4002}, results: []error{taken, nil}, want: 4002, added: []int{4001, 4002}},
		{name: "QMP failure ends at once", picks: []int{4001, 4002}, results: []error{qmpDown}, wantErr: qmpDown, added: []int{4001}},
		{name: "every pick taken", picks: []int{1, 2, 3}, results: []error{taken, taken, taken}, wantErr: taken, added: []int{1, 2, 3}},
		{name: "no free port", pickErr: pickErr, wantErr: pickErr},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var added []int
			i := 0
			pick := func() (int, error) {
				if tc.pickErr != nil {
					return 0, tc.pickErr
				}
				p := tc.picks[i]
				i++
				return p, nil
			}
			add := func(hp int) (bool, error) {
				added = append(added, hp)
				err := tc.results[len(added)-1]
				return errors.Is(err, taken), err
			}
			got, err := forwardFreePort(3, pick, add)
			assert.Equal(t, tc.added, added, "ports tried")
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}
