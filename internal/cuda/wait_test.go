package cuda

import (
	"strings"
	"testing"
)

// TestHostWaitEnv runs everywhere: WaitEnv's values, and a bad one named.
func TestHostWaitEnv(t *testing.T) {
	for v, want := range map[string]HostWait{"": WaitSpin, "spin": WaitSpin, "sleep": WaitSleep} {
		t.Setenv(WaitEnv, v)
		if got, err := hostWaitFromEnv(); err != nil || got != want {
			t.Errorf("%s=%q: %v, %v; want %v", WaitEnv, v, got, err, want)
		}
	}
	t.Setenv(WaitEnv, "yield")
	if _, err := hostWaitFromEnv(); err == nil || !strings.Contains(err.Error(), WaitEnv) || !strings.Contains(err.Error(), `"yield"`) {
		t.Errorf("%s=yield: error %v, want one naming the variable and the value", WaitEnv, err)
	}
	if err := SetHostWait(HostWait(7)); err == nil || !strings.Contains(err.Error(), "HostWait(7)") {
		t.Errorf("SetHostWait(7): %v", err)
	}
	if WaitSpin.String() != "spin" || WaitSleep.String() != "sleep" {
		t.Errorf("names %q, %q", WaitSpin, WaitSleep)
	}
}
